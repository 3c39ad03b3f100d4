"""Command-line flags of a worker process, mapped onto ``WorkerSettings`` in one place."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from foundation.tracing import add_tracing_arguments
from foundation.zmq_auth import add_security_arguments
from transfer.link_names import CHECKSUM_CHOICES, DEFAULT_TRANSFER_CHECKSUM, LINK_CHOICES, transfer_checksum_on
from worker.prompt_priority import SCHEDULING
from worker.settings import WorkerSettings


def add_worker_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = WorkerSettings(role="prefill", model="")
    parser.add_argument("--model", default=os.environ.get("KVROUTE_MODEL"),
                        help="model folder or hub id (default: SmolLM2-135M-Instruct, prepared on demand)")
    parser.add_argument("--worker-id", default="", help="stable name of this worker (default: role + random)")
    parser.add_argument("--dtype", default=defaults.dtype,
                        help="engine dtype; auto: bfloat16 where the hardware has bf16 instructions, "
                             "else float32 (default: %(default)s)")
    parser.add_argument("--kv-cache-gib", type=float, default=defaults.kv_cache_gib,
                        help="KV cache size in GiB, fractions allowed (default: %(default)s)")
    parser.add_argument("--block-size", type=int, default=None,
                        help="KV block size in tokens (default: 32 on CPU, vLLM's on GPU)")
    parser.add_argument("--max-model-len", type=int, default=defaults.max_model_len,
                        help="longest prompt + output in tokens (default: %(default)s)")
    parser.add_argument("--host", default=defaults.host, help="address peers use to reach this worker")
    parser.add_argument("--bind-host", default=defaults.bind_host, help="interface to bind (default: %(default)s)")
    parser.add_argument("--orchestrator", action="append", default=None,
                        help="orchestrator registration address, e.g. tcp://10.0.0.1:7001, or dns://NAME:PORT "
                             "for every address NAME resolves to (a headless Service's replicas), looked up "
                             "again every --orchestrator-resolve-seconds; repeat for replicas (env "
                             "KVROUTE_ORCHESTRATOR, comma-separated)")
    parser.add_argument("--orchestrator-resolve-seconds", type=float, default=defaults.orchestrator_resolve_seconds,
                        help="how often a dns:// orchestrator name is looked up again (default: %(default)s)")
    parser.add_argument("--status-file", default=os.environ.get("KVROUTE_STATUS_FILE", ""),
                        help="write the worker's health here after every heartbeat round, for `kvroute probe "
                             "worker` (env KVROUTE_STATUS_FILE; default: none)")
    parser.add_argument("--heartbeat-seconds", type=float, default=defaults.heartbeat_seconds,
                        help="heartbeat interval (default: %(default)s)")
    for name in ("rpc", "kv-events", "transfer"):
        parser.add_argument(f"--{name}-port", type=int, default=0, help=f"{name} port (default: a free one)")
    parser.add_argument("--lease-seconds", type=float, default=defaults.lease_seconds,
                        help="producer: free unpulled blocks after this long (default: %(default)s)")
    parser.add_argument("--lease-staging-gib", type=float, default=defaults.lease_staging_gib,
                        help="producer: host memory for copies of leased blocks, so the engine frees "
                             "them at once; 0 holds them in the engine (default: %(default)s)")
    parser.add_argument("--pull-timeout-seconds", type=float, default=defaults.pull_timeout_seconds,
                        help="consumer: recompute when a pull takes longer (default: %(default)s)")
    parser.add_argument("--drain-seconds", type=float, default=defaults.drain_seconds,
                        help="on SIGTERM, refuse new requests and wait this long at most for running ones "
                             "and held leases to end; a second SIGTERM or SIGINT stops at once "
                             "(default: %(default)s)")
    parser.add_argument("--long-prefill-tokens", type=int, default=None,
                        help="most prompt tokens one request computes per engine step while others wait; "
                             "0: no cap (default: 256 on prefill and decode workers, so a long prompt cannot "
                             "hold arriving KV pulls, running streams or a waiting cache hit for seconds; "
                             "none on unified workers, which serve like one plain vLLM server)")
    parser.add_argument("--step-tokens", type=int, default=None,
                        help="most prompt tokens one engine step computes over all requests "
                             "(default: the engine's, 2048)")
    parser.add_argument("--decoding-step-tokens", type=int, default=defaults.decoding_step_tokens,
                        help="a fixed cap instead: most prompt tokens one engine step computes while any "
                             "request decodes; 0: none, steps follow the decoding requests' TPOT targets "
                             "(default: %(default)s)")
    parser.add_argument("--decoding-tpot-target", type=float, default=defaults.decoding_tpot_target,
                        help="seconds a token for decoding requests that carry no target of their own (the "
                             "orchestrator gives every request its TPOT target, 0.15 s unless asked): while "
                             "requests decode, a step computes only the prompt tokens that keep each stream "
                             "at its average; 0: none (default: %(default)s)")
    parser.add_argument("--scheduling", choices=SCHEDULING, default=defaults.scheduling,
                        help="which waiting prompt the engine computes first: fcfs (vLLM's arrival order) or "
                             "shortest-first (the shortest expected prefill, a long prompt overtaken only by "
                             "prompts arriving within about its own prefill time; default: %(default)s)")
    parser.add_argument("--probe-tokens", type=int, default=defaults.probe_tokens,
                        help="tokens of the timed prefill at start-up that tells orchestrators how fast "
                             "this worker prefills before its first request; 0: none (default: %(default)s)")
    parser.add_argument("--omp-threads-bind", default=None,
                        help="CPU cores for the engine's OpenMP threads, e.g. '0' or '0-3' (CPU builds)")
    parser.add_argument("--transfer-cpus", default="",
                        help="CPUs for the KV transfer threads, e.g. '2-3', kept apart from the engine's "
                             "cores (default: every CPU)")
    parser.add_argument("--transfer-link", default=defaults.transfer_link, choices=LINK_CHOICES,
                        help="how pulled KV travels: 'endpoint', back on the pull's own connection, or a "
                             "transport link per worker pair: 'auto' (CUDA caches: nccl; one host: zmq-ipc; "
                             "else zmq-tcp) or a backend forcing it: zmq-tcp, zmq-ipc, gloo, nccl, nixl (NIXL "
                             "one-sided READs; needs nixl-cu12) (default: %(default)s)")
    parser.add_argument("--transfer-link-hosts", default=defaults.transfer_link_hosts,
                        help="link backends this worker's transfer endpoint hosts when a consumer asks, "
                             "comma-separated, e.g. 'zmq-ipc,zmq-tcp,gloo' (default: what --transfer-link "
                             "implies: with 'endpoint' zmq-ipc and zmq-tcp, with 'auto' what auto picks, with "
                             "a backend that one and the ZeroMQ ones); any other is refused at first contact")
    parser.add_argument("--no-shared-copies", dest="shared_copies", action="store_false",
                        help="stage leases in private memory and always send pulled KV as frames, also "
                             "between workers on one host (default: a consumer on the producer's host reads "
                             "the staged copy from shared memory straight into its cache)")
    parser.add_argument("--no-evict-pulled-first", dest="evict_pulled_first", action="store_false",
                        help="keep pulled prompt blocks in vLLM's plain LRU order (default: a decode worker "
                             "evicts the prompts it pulled before the ones it prefilled itself, since the "
                             "prefill worker most likely still holds them)")
    parser.add_argument("--transfer-checksum", default=DEFAULT_TRANSFER_CHECKSUM, choices=CHECKSUM_CHOICES,
                        help="decode worker: ask for an xxh3 checksum of every pulled frame and check it before "
                             "the frame reaches the KV cache; a mismatch fails the pull and the prompt is "
                             "recomputed. Frames read from a shared copy on one host carry none "
                             "(default: %(default)s)")
    parser.add_argument("--node-store", default=os.environ.get("KVROUTE_NODE_STORE", ""),
                        help="the node KV store of this host (`kvroute node-store`), e.g. tcp://127.0.0.1:7390: "
                             "new prompt blocks are written through to it, and a prompt whose leading blocks this "
                             "engine lacks loads them from it (env KVROUTE_NODE_STORE; default: none)")
    add_security_arguments(parser)
    add_tracing_arguments(parser)
    parser.add_argument("--ready-file", type=Path, default=None,
                        help="write the worker's addresses as JSON here once it serves")


def settings_from_args(args: argparse.Namespace, role: str) -> WorkerSettings:
    from foundation.model_prep import resolve_model
    from worker.dtype import resolve_here

    return WorkerSettings(
        role=role, model=resolve_model(args.model), worker_id=args.worker_id, dtype=resolve_here(args.dtype),
        kv_cache_gib=args.kv_cache_gib, block_size=args.block_size, max_model_len=args.max_model_len,
        host=args.host, bind_host=args.bind_host, rpc_port=args.rpc_port,
        kv_events_port=args.kv_events_port, orchestrators=orchestrator_addresses(args),
        orchestrator_resolve_seconds=args.orchestrator_resolve_seconds, status_file=args.status_file,
        heartbeat_seconds=args.heartbeat_seconds,
        transfer_port=args.transfer_port, lease_seconds=args.lease_seconds,
        lease_staging_gib=args.lease_staging_gib,
        pull_timeout_seconds=args.pull_timeout_seconds, drain_seconds=args.drain_seconds,
        omp_threads_bind=args.omp_threads_bind,
        transfer_cpus=args.transfer_cpus, long_prefill_tokens=args.long_prefill_tokens,
        step_tokens=args.step_tokens, scheduling=args.scheduling, probe_tokens=args.probe_tokens,
        decoding_step_tokens=args.decoding_step_tokens, decoding_tpot_target=args.decoding_tpot_target,
        transfer_link=args.transfer_link, transfer_link_hosts=args.transfer_link_hosts,
        shared_copies=args.shared_copies,
        evict_pulled_first=args.evict_pulled_first, cluster_keys=args.cluster_keys,
        insecure_no_auth=args.insecure_no_auth, transfer_encryption=args.transfer_encryption == "on",
        transfer_checksum=transfer_checksum_on(args.transfer_checksum), node_store=args.node_store,
        otlp_endpoint=args.otlp_endpoint, otlp_protocol=args.otlp_protocol)


def orchestrator_addresses(args: argparse.Namespace) -> tuple[str, ...]:
    if args.orchestrator:
        return tuple(args.orchestrator)
    return tuple(a for a in os.environ.get("KVROUTE_ORCHESTRATOR", "").split(",") if a)


def main(role: str, argv: list[str] | None = None) -> None:
    from worker.process import run_worker

    parser = argparse.ArgumentParser(prog=f"{role}_worker", description=f"kvroute {role} worker")
    add_worker_arguments(parser)
    args = parser.parse_args(argv)
    run_worker(settings_from_args(args, role), args.ready_file)
