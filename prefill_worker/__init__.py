"""kvroute's prefill worker: a vLLM engine whose connector holds finished prompts' blocks for decode workers to pull."""
