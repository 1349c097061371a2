"""acme-mixer: a causal MLP-Mixer language model packaged as a third-party zoo plugin."""
