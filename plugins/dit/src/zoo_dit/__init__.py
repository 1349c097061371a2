"""DiT with EDM for zoo."""
