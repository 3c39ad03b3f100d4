"""The process that hosts one vLLM engine for kvroute, shared by both roles.

Engine, RPC server, heartbeat, drain and queued-prefill reports are the same for a prefill
and a decode worker; ``prefill_worker`` and ``decode_worker`` are the role entry points.
What a role does differently happens in the KV connector (``transfer.connector``): a
producer holds finished prompts' blocks and serves leases, a consumer pulls the blocks it
lacks and evicts pulled prompts first."""
