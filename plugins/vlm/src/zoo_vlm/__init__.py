"""zoo-vlm: CLIP and LLaVA-style vision-language models."""
