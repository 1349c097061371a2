"""zoo-gpt: GPT-2 and LLaMA as flavors of one decoder."""
