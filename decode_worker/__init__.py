"""kvroute's decode worker: a vLLM engine whose connector pulls the prompt blocks it lacks from prefill workers."""
