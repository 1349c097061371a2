"""zoo-moe: Mixtral and Qwen2-MoE decoders (declarations in `plugin`, the model in `model`)."""
