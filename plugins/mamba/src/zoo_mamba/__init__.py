"""zoo-mamba: Mamba-1, Mamba-2 and hybrid state-space decoders."""
