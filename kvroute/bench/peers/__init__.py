"""``kvroute bench peers``: kvroute against what a user would run instead, side by side.

Each system ("peer") is started on this machine with the same model, dtype, block size,
total KV memory, prefix caching and context length, measured with kvroute's own replay
client (``kvroute.bench.replay``) on the same requests at every swept rate, and stopped
before the next one starts. The modules, one job each:

* ``resources``: the equal-resources rules: model, dtype, cores, the KV budget and its split;
* ``router_env``: vllm-router, pinned, installed lazily into a virtual environment of its own;
* ``systems``: what each peer starts (pure plans), and starting, resetting and stopping them
  as process groups;
* ``sources``: the workloads of the sweep, at a given rate and size;
* ``run``: the sweep: per system, per workload, per rate: reset, replay, summarise;
* ``report``: SLO attainment, goodput, winners and ratios, results.json and the terminal table;
* ``plots``: latency against rate, goodput bars;
* ``cli``: the command.
"""
