"""kvroute's orchestrator: places requests on workers and drives them."""
