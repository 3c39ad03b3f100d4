"""kvroute's prefill worker: a vLLM engine that computes prompts and holds their KV blocks
for decode workers to pull. Run one with ``python -m prefill_worker`` (or
``kvroute prefill-worker``); its flags are the worker host's (``worker.cli_args``).

The process is the worker host both roles share (``worker/``: engine, RPC server,
heartbeat, drain). What makes it a producer happens inside its engine, in the KV
connector's producer side:

* ``transfer.connector_scheduler`` — when a prompt's prefill finishes, keep its blocks
  (``hold_blocks``) instead of freeing them;
* ``transfer.leases`` — a lease per finished prompt, ended by the consumer's release, by
  ``--lease-seconds`` or by a drain;
* ``transfer.block_server`` — the transfer endpoint that serves leased blocks, releases
  leases and reports counters;
* ``transfer.shared_copies`` and ``transfer.send_buffers`` — staging a lease's blocks in
  host memory (``--lease-staging-gib``) so the engine can free them at once, in shared
  memory for consumers on the same host.
"""
