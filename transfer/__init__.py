"""The KV transfer plane: the vLLM connector and the block transport under it."""
