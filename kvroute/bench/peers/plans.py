"""What each peer starts, as data: the processes, their flags and environments, how its caches reset.

Pure: ports come from the ``port`` callable and nothing is started here (``systems`` does
that), so every command line can be checked in a unit test. The peers:

* ``kvroute``: ``python -m kvroute serve --topology T --total-kv-gib X`` plus ``--kvroute-args``;
* ``kvroute-tier``: the same with a node KV store of ``--tier-kv-multiple`` (8) times X of host
  memory behind its engines (``serve --host-kv-gib``);
* ``vllm``: one vLLM OpenAI server on every core with the whole KV budget;
* ``router-<policy>``: N vLLM servers, each on its own core(s) with 1/N of the budget, behind
  vllm-router with that policy; ``kv_aware`` also feeds the router every server's KV events
  (through ``event_relay``, loopback only) and lets it render prompts (``--enable-scale-out``);
* ``router-pd``: vllm-router's P/D mode over vLLM's NixlConnector (``router_pd_plan``); skipped,
  with the reason ``pd_skip_reason`` gives, where the ``nixl`` package is missing.

Every vLLM server: ``--enable-prefix-caching --block-size 32 --enable-prompt-tokens-details``
(so usage reports cached tokens), the dtype and context length of ``Resources``,
``--enforce-eager`` as kvroute's own engines run, and ``VLLM_SERVER_DEV_MODE=1`` for
``POST /reset_prefix_cache``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib.util import find_spec
from pathlib import Path

from kvroute.bench.peers.resources import Resources
from kvroute.topology import cpu_list, split_cores
from orchestrator.planner.settings import DEFAULT_TPOT_TARGET_SECONDS, PlannerSettings

KVROUTE, KVROUTE_TIER, VLLM, ROUTER_PD = "kvroute", "kvroute-tier", "vllm", "router-pd"
ROUTER_POLICIES = ("cache_aware", "kv_aware")
SYSTEMS = (KVROUTE, KVROUTE_TIER, VLLM, *(f"router-{policy}" for policy in ROUTER_POLICIES), ROUTER_PD)
# kvroute-tier explains (what the node KV tier buys kvroute); it runs when named.
# kvroute-tier is no peer; router-pd's idle servers spin (run it alone or --sequential): both only when named.
DEFAULT_SYSTEMS = tuple(system for system in SYSTEMS if system not in (KVROUTE_TIER, ROUTER_PD))
LOOPBACK = "127.0.0.1"
KV_EVENTS_TOPIC = "kv-events"

RESET_KVROUTE = "kvroute"  # POST /admin/reset-cache (ReplayServer.reset_cache)
RESET_ENGINES = "engines"  # POST /reset_prefix_cache on every vLLM server


@dataclass(frozen=True)
class Launch:
    """One process of a system, started in order: ready when ``ready_url`` answers 200 and,
    if set, ``ready_log`` appears in its log; ``restart_between_runs`` for a router, whose own
    prefix tree has no reset endpoint."""

    name: str
    argv: tuple[str, ...]
    env: tuple[tuple[str, str], ...] = ()
    ready_url: str | None = None
    ready_log: str | None = None
    restart_between_runs: bool = False


@dataclass(frozen=True)
class Plan:
    system: str
    url: str  # where the client sends requests
    launches: tuple[Launch, ...]
    reset: str  # RESET_KVROUTE or RESET_ENGINES
    engine_urls: tuple[str, ...] = ()  # the vLLM servers RESET_ENGINES empties
    kvroute_api: bool = False  # the client fetches /v1/decisions
    description: str = ""
    settings: dict = field(default_factory=dict)  # what defines the system, for results.json


@dataclass(frozen=True)
class PeerOptions:
    kvroute_topology: str = "auto"
    kvroute_args: tuple[str, ...] = ()
    vllm_args: tuple[str, ...] = ()
    router_servers: int = 2
    router_args: tuple[str, ...] = ()
    router_binary: str = "vllm-router"
    python: str = sys.executable
    tier_kv_multiple: float = 8.0  # kvroute-tier's node store, in multiples of the engines' KV


def url(port: int) -> str:
    return f"http://{LOOPBACK}:{port}"


# ---------------------------------------------------------------- kvroute


def kvroute_plan(res: Resources, options: PeerOptions, port: Callable[[], int], log_dir: Path,
                 tier: bool = False) -> Plan:
    """``tier``: kvroute-tier, with a node store of ``options.tier_kv_multiple`` x the KV budget."""
    own = port()
    system = KVROUTE_TIER if tier else KVROUTE
    sizing = ["--topology", options.kvroute_topology, "--total-kv-gib", f"{res.total_kv_gib:g}"]
    # The planner's defaults of this run, for a later simulation of it (``kvroute bench fit-shapes``):
    # defaults change between versions, and --kvroute-args may not name them.
    defaults = {"max_in_flight_per_worker": PlannerSettings.max_in_flight,
                "tpot_target_seconds": DEFAULT_TPOT_TARGET_SECONDS}
    settings = {"topology": options.kvroute_topology, "total_kv_gib": res.total_kv_gib, "planner_defaults": defaults}
    description = f"kvroute serve, topology {options.kvroute_topology}"
    if tier:
        host_kv_gib = options.tier_kv_multiple * res.total_kv_gib
        sizing += ["--host-kv-gib", f"{host_kv_gib:g}"]
        settings["host_kv_gib"] = host_kv_gib
        description += f", node store of {host_kv_gib:g} GiB host memory"
    # --allow-policy-override only so that the cache reset may step each engine with a named
    # policy (ReplayServer.reset_cache); measured requests name none and get serve's default.
    argv = (options.python, "-m", "kvroute", "serve", "--host", LOOPBACK, "--port", str(own),
            "--dtype", res.dtype, "--max-model-len", str(res.max_model_len), "--allow-policy-override",
            "--log-dir", str(log_dir / f"{system}-workers"), *sizing, *options.kvroute_args)
    launch = Launch(system, argv, ready_url=url(own) + "/health", ready_log="kvroute is serving at")
    return Plan(system, url(own), (launch,), RESET_KVROUTE, kvroute_api=True, description=description,
                settings={**settings, "extra_args": list(options.kvroute_args)})


# ---------------------------------------------------------------- vLLM servers


def vllm_server(name: str, res: Resources, options: PeerOptions, own: int, cores: str,
                kv_bytes: int, events_endpoint: str | None = None,
                nixl_role: tuple[str, int] | None = None) -> Launch:
    """``nixl_role``: (vLLM's kv_role, side-channel port) for a P/D server joined by vLLM's NixlConnector."""
    argv = [options.python, "-m", "vllm.entrypoints.openai.api_server", "--model", res.model,
            "--served-model-name", res.served_model, "--host", LOOPBACK, "--port", str(own),
            "--dtype", res.dtype, "--block-size", str(res.block_size), "--enable-prefix-caching",
            "--kv-cache-memory-bytes", str(kv_bytes), "--max-model-len", str(res.max_model_len),
            "--enable-prompt-tokens-details", "--enforce-eager", "--disable-uvicorn-access-log"]
    if events_endpoint:
        config = {"enable_kv_cache_events": True, "publisher": "zmq", "endpoint": events_endpoint,
                  "topic": KV_EVENTS_TOPIC}
        argv += ["--kv-events-config", json.dumps(config), "--enable-scale-out"]
    env = (("VLLM_CPU_OMP_THREADS_BIND", cores), ("VLLM_SERVER_DEV_MODE", "1"),
           ("PYTHONHASHSEED", "0"))  # a fixed seed of vLLM's block hashes, which kv_aware indexes
    if nixl_role is not None:
        kv_role, side_channel = nixl_role
        # The KV cache is host memory here; the side channel (NIXL metadata) listens on loopback only.
        argv += ["--kv-transfer-config", json.dumps({"kv_connector": "NixlConnector", "kv_role": kv_role,
                                                     "kv_buffer_device": "cpu"})]
        env += (("VLLM_NIXL_SIDE_CHANNEL_HOST", LOOPBACK), ("VLLM_NIXL_SIDE_CHANNEL_PORT", str(side_channel)))
    return Launch(name, (*argv, *options.vllm_args), env, ready_url=url(own) + "/health")


def vllm_plan(res: Resources, options: PeerOptions, port: Callable[[], int]) -> Plan:
    own = port()
    server = vllm_server(VLLM, res, options, own, cpu_list(res.cores), res.total_kv_bytes)
    return Plan(VLLM, url(own), (server,), RESET_ENGINES, (url(own),),
                description=f"one vLLM server on cores {cpu_list(res.cores)}, {res.total_kv_gib:g} GiB KV",
                settings={"servers": 1, "cores": cpu_list(res.cores), "kv_bytes": res.total_kv_bytes,
                          "extra_args": list(options.vllm_args)})


# ---------------------------------------------------------------- vllm-router


def router_plan(policy: str, res: Resources, options: PeerOptions, port: Callable[[], int]) -> Plan:
    """``options.router_servers`` vLLM servers, then the router (and, for kv_aware, the relays)."""
    count = options.router_servers
    shares = split_cores(res.cores, count)
    kv_bytes = res.kv_bytes_each(count)
    ports = [port() for _ in range(count)]
    servers, relays, sources = [], [], []
    for k, (own, cores) in enumerate(zip(ports, shares)):
        events = None
        if policy == "kv_aware":
            inbound, outbound = f"tcp://{LOOPBACK}:{port()}", f"tcp://{LOOPBACK}:{port()}"
            relays.append(Launch(f"event-relay-{k}", (options.python, "-m", "kvroute.bench.peers.event_relay",
                                                      "--inbound", inbound, "--outbound", outbound)))
            sources += ["--kv-event-source", f"{url(own)}={outbound}"]
            events = inbound
        servers.append(vllm_server(f"vllm-{k}", res, options, own, cores, kv_bytes, events))
    front = port()
    routing = ["--policy", policy, "--worker-urls", *(url(own) for own in ports)]
    if policy == "kv_aware":
        # debug: the router logs each decision's credited prefix tokens (report.kv_aware_credits)
        routing += [*sources, "--kv-event-block-size", str(res.block_size), "--kv-event-model", res.served_model,
                    "--log-level", "debug"]
    router = router_launch(options, front, port, routing)
    return Plan(f"router-{policy}", url(front), (*relays, *servers, router), RESET_ENGINES,
                tuple(url(own) for own in ports),
                description=f"vllm-router {policy} over {count} vLLM servers",
                settings={"policy": policy, "servers": count, "cores": shares,
                          "kv_bytes_each": kv_bytes, "extra_args": list(options.vllm_args),
                          "router_args": list(options.router_args)})


def router_launch(options: PeerOptions, front: int, port: Callable[[], int], routing: list[str]) -> Launch:
    """vllm-router on ``front`` with ``routing`` (its mode, policy and servers), metrics on loopback."""
    argv = [options.router_binary, "--host", LOOPBACK, "--port", str(front), *routing,
            "--prometheus-host", LOOPBACK, "--prometheus-port", str(port()), *options.router_args]
    return Launch("router", tuple(argv), ready_url=url(front) + "/v1/models", restart_between_runs=True)


def pd_skip_reason() -> str:
    """Why ``router-pd`` cannot run here ("" when it can). vllm-router's P/D mode
    (--vllm-pd-disaggregation) sends prefill and decode to engines joined by vLLM's NIXL,
    Mooncake or MoRI-IO connector; its NixlConnector imports ``nixl``, the meta package whose
    own code is a 12 KB shim over the ``nixl_cu12`` wheel (installed by ``make setup``, both
    without dependencies)."""
    if find_spec("nixl") is None or find_spec("nixl_cu12") is None:
        return ("vllm-router's P/D mode needs vLLM engines joined by the NIXL KV connector, which imports "
                "the nixl package (pip install --no-deps nixl==1.5.1 nixl-cu12==1.5.1; make setup does)")
    return ""


def router_pd_plan(res: Resources, options: PeerOptions, port: Callable[[], int]) -> Plan:
    """vllm-router's P/D mode over vLLM's own disaggregation: half of ``options.router_servers``
    vLLM servers prefill (kv_producer), the rest decode (kv_consumer), joined by vLLM's
    NixlConnector; the router sends each request to a prefill server, then to a decode server,
    which READs the prompt's KV from it with NIXL."""
    count = max(2, options.router_servers)
    shares = split_cores(res.cores, count)
    kv_bytes = res.kv_bytes_each(count)
    ports = [port() for _ in range(count)]
    prefills = count // 2
    servers = [vllm_server(f"vllm-{'prefill' if k < prefills else 'decode'}-{k}", res, options, own, cores, kv_bytes,
                           nixl_role=("kv_producer" if k < prefills else "kv_consumer", port()))
               for k, (own, cores) in enumerate(zip(ports, shares))]
    front = port()
    routing = ["--vllm-pd-disaggregation", "--kv-connector", "nixl", "--policy", "cache_aware"]
    for own in ports[:prefills]:
        routing += ["--prefill", url(own)]
    for own in ports[prefills:]:
        routing += ["--decode", url(own)]
    router = router_launch(options, front, port, routing)
    return Plan(ROUTER_PD, url(front), (*servers, router), RESET_ENGINES, tuple(url(own) for own in ports),
                description=f"vllm-router P/D over {prefills} prefill and {count - prefills} decode vLLM servers "
                            "(vLLM's NixlConnector)",
                settings={"policy": "cache_aware", "servers": count, "prefill_servers": prefills, "cores": shares,
                          "kv_bytes_each": kv_bytes, "kv_connector": "NixlConnector",
                          "extra_args": list(options.vllm_args), "router_args": list(options.router_args)})
