"""The process that hosts one vLLM engine for kvroute (prefill or decode role)."""
