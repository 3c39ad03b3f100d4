"""``kvroute bench orchestrator``: the orchestrator's overhead, its HTTP API against driving
the workers directly (``cli``). ``clients``: the two ways to run the same request;
``measure``: interleaved sequential requests and closed-loop throughput, both ways."""
