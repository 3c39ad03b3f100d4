"""``kvroute bench disagg``: the disaggregated path on this machine, TTFT and KV transfer
throughput, between a prefill worker and a decode worker it starts (``cli``).

``handoff``: single-engine and disaggregated requests, timed (the TTFT and end-to-end
phases); ``transfers``: the connector's block pulls against raw pyzmq; ``report``: the
verdict and the tables; ``context``: what the phases share; ``prompts``: distinct prompts;
``processes``: the workers' processes as /proc shows them.
"""
