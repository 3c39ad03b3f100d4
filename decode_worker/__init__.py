"""kvroute's decode worker: a vLLM engine that pulls the prompt blocks it lacks from a
prefill worker and generates the rest of the tokens. Run one with ``python -m
decode_worker`` (or ``kvroute decode-worker``); its flags are the worker host's
(``worker.cli_args``).

The process is the worker host both roles share (``worker/``: engine, RPC server,
heartbeat, drain). What makes it a consumer happens inside its engine, in the KV
connector's consumer side:

* ``transfer.connector_scheduler`` — reports the pulled prompt tokens as computed
  externally, and after the request puts its pulled blocks first in line for eviction
  (``transfer.free_queue``; ``--no-evict-pulled-first`` turns it off);
* ``transfer.connector_worker`` — pulls only the blocks missing from its own prefix cache
  (``transfer.block_client``, or a link: ``transfer.link_control``), writes them into its
  cache rows (``transfer.kv_layout``), and falls back to recomputing when a pull fails or
  exceeds ``--pull-timeout-seconds``;
* ``transfer.pull_records`` — what each request pulled, reported back to the orchestrator.
"""
