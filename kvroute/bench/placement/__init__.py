"""Placement policies side by side on one embedded cluster that the measurement starts:
``kvroute bench placement`` (the repository-assistant workload, ``repository``) and
``kvroute bench trace`` (a Mooncake trace, ``trace``). ``cluster``: the cluster and its
sizing; ``runs``: the per-policy replay loop and the report both write.

``kvroute bench replay`` replays the same way (``kvroute.bench.replay``) against a cluster
that is already running; these start theirs, size its caches from the workload, warm it up
and record what the simulator needs to be fitted to the run (``simulator.from_replay``).
"""
