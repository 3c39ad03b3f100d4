"""kvroute's unified worker: one vLLM engine that prefills and decodes, an aggregated
replica. Run one with ``python -m unified_worker`` (or ``kvroute unified-worker``); its
flags are the worker host's (``worker.cli_args``).

The planner puts it in both pools (``foundation.wire.serves``): it serves a request
alone (LOCAL), prefills for a decode or unified worker elsewhere (DISAGG, its connector
lending the prompt's blocks like a prefill worker's), or decodes a prompt another worker
prefilled (its connector pulling the blocks it lacks like a decode worker's). Its engine's
connector is ``kv_both`` (``worker.engine.KV_ROLE``); both halves are in ``transfer``.
"""
