"""The transfer phase of ``kvroute bench disagg``: the connector's block pull against a raw
pyzmq zero-copy baseline moving the same bytes in the same frames (one per layer): from the
producer's shared copy, as frames over its own endpoint, and over each transport link."""

from __future__ import annotations

import asyncio
import os
import time
import uuid
from dataclasses import dataclass, field

from kvroute.bench.disagg.context import LEASE_RENEW_SECONDS, MiB, console, gbps, median, summary
from kvroute.bench.disagg.processes import listening_pid
from kvroute.bench.meters import CpuMeter, ForeignLoad
from transfer.affinity import parse_cpus, transfer_cpus


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


RAW_VARIANTS = ("raw", "raw_fresh_socket", "raw_scatter")
LEASE_VARIANTS = ("connector_shared", "connector_scatter", "connector_noop", "raw_during_lease")


async def measure_transfers(ctx) -> dict:
    import torch
    import zmq

    from foundation.endpoint_client import ChannelPool, fetch_transfer_stats
    from kvroute.bench.transfer_raw import RawReceiver, RawSender, fake_cache_layers
    from transfer.kv_layout import PagedKVCache
    from transfer.link_control import open_consumer_link
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
    link_variants = {f"link_{backend}_scatter": backend for backend in ctx.args.links}
    all_cpus = sorted(os.sched_getaffinity(0))
    previous_threads = torch.get_num_threads()
    # Senders first: they are spawned from this thread and must not inherit the receiver's pinning.
    with RawSender(cpus=sender_cpus) as sender, RawSender(cpus=all_cpus) as free_sender:
        os.sched_setaffinity(0, receiver_cpus)  # this thread only; threads started from here inherit it
        torch.set_num_threads(receiver_threads)
        context = zmq.Context()  # its I/O thread starts now, on the receiver's CPUs
        rig = Rig(ctx, layout, fake, cache_blocks, context, RawReceiver(sender.address, context),
                  RawReceiver(free_sender.address, context),
                  ChannelPool(context))  # the connector keeps its connections to producers open
        # The connector over transport links (--transfer-link), opened once per backend as a
        # decode worker opens one per producer; the producer's block server hosts them.
        rig.links = {name: open_consumer_link(context, ctx.prefill_worker.transfer_address, layout,
                                               torch.device("cpu"), TransportSettings(backend=backend))
                     for name, backend in link_variants.items()}
        try:
            for target, blocks in plan:
                entry = results["sizes"][f"{target:g}"] = await rig.measure_size(target, blocks)
                if entry["shared_copy_reads"] != 1 + ctx.args.reps:
                    raise RuntimeError(f"the producer offered its shared copy to {entry['shared_copy_reads']} of "
                                       f"{1 + ctx.args.reps} pulls; was it started with --no-shared-copies?")
                log_size(entry, link_variants)
        finally:
            rig.close()
            os.sched_setaffinity(0, all_cpus)
            torch.set_num_threads(previous_threads)
    return results


@dataclass
class Rig:
    """This process's receiving end of every variant, for one producer.

    Two phases per size, because a held lease is not free on this machine: while one is held
    the producer's engine keeps stepping and its model worker spins (sched_yield) on its
    pinned core, which starves any other process pinned there (the raw sender would wait
    tens of seconds). So the raw baseline runs with no lease held (engine idle, sender on the
    block server's CPUs); the connector runs under its lease, as it does in service. A raw
    run during the lease with an unpinned sender shows how much of the gap is that contention.
    """

    ctx: object
    layout: object
    fake: object  # the stand-in paged cache pulled blocks are scattered into
    cache_blocks: int
    context: object  # zmq.Context
    receiver: object  # from the raw sender pinned like the block server
    free_receiver: object  # from the unpinned raw sender
    channels: object
    links: dict = field(default_factory=dict)  # variant name -> consumer link

    def close(self) -> None:
        for link in self.links.values():
            link.close()
        self.channels.close()
        self.receiver.close()
        self.free_receiver.close()
        self.context.destroy(linger=0)

    async def measure_size(self, target: float, blocks: int) -> dict:
        from foundation.endpoint_client import release_lease
        from kvroute.bench.transfer_raw import destination_blocks
        from transfer.block_client import pull_blocks
        from transfer.kv_layout import block_index_tensor
        from transfer.link_control import pull_over_link
        from transfer.shared_copies import read_shared_copy

        ctx, layout, context, channels = self.ctx, self.layout, self.context, self.channels
        receiver, free_receiver = self.receiver, self.free_receiver
        lease_variants = (*LEASE_VARIANTS, *self.links)
        block_size = layout.block_size
        frame_bytes = blocks * layout.bytes_per_block // layout.num_layers
        nbytes = frame_bytes * layout.num_layers
        local_ids = destination_blocks(self.cache_blocks, blocks, seed=blocks)
        local = block_index_tensor(local_ids)
        scatter = lambda layer, data: self.fake.scatter_layer(layer, local, data)  # noqa: E731
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
        samples: dict[str, list[float]] = {name: [] for name in RAW_VARIANTS + lease_variants}
        cold = {name: run[name]() for name in RAW_VARIANTS}  # warm-up, not counted
        cpu_idle = CpuMeter(ctx.prefill_worker.process.pid, group=True)
        for _ in range(ctx.args.reps):  # interleaved, so drift hits every variant alike
            for name in RAW_VARIANTS:
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
            return read_shared_copy(ref, self.fake, local_ids, indices)

        def connector(sink, shared=None) -> float:
            start = time.perf_counter()
            got = pull_blocks(context, source, indices, layout, sink, time.monotonic() + 60, channels,
                              read_shared=shared)
            elapsed = time.perf_counter() - start
            assert got == nbytes, (got, nbytes)
            return elapsed

        def over_link(name: str) -> float:
            start = time.perf_counter()
            got = pull_over_link(context, source, indices, layout, self.links[name], scatter, time.monotonic() + 60,
                                 channels)
            elapsed = time.perf_counter() - start
            assert got == nbytes, (got, nbytes)
            return elapsed

        renewals = 0
        for name in self.links:
            run[name] = lambda name=name: over_link(name)
        run["connector_scatter"] = lambda: connector(scatter)
        run["connector_shared"] = lambda: connector(scatter, read_shared)
        run["connector_noop"] = lambda: connector(lambda layer, data: None)
        try:
            cold.update({name: run[name]() for name in lease_variants})
            cpu_lease = CpuMeter(ctx.prefill_worker.process.pid, group=True)
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
        return {
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
               for name in self.links},
        }


def log_size(entry: dict, link_variants: dict[str, str]) -> None:
    console.log(f"{entry['bytes'] / MiB:.1f} MiB ({entry['blocks']} blocks): connector "
                f"{entry['connector_shared']['median_gbps']:.2f} GB/s from the shared copy "
                f"(ratio {entry['ratio_connector_shared_vs_raw']:.2f}), "
                f"{entry['connector_scatter']['median_gbps']:.2f} GB/s as frames, raw "
                f"{entry['raw']['median_gbps']:.2f} GB/s, ratio {entry['ratio_connector_vs_raw']:.2f}; "
                f"prefill worker CPU {entry['prefill_worker_cpu_cores_idle']:.2f} cores idle, "
                f"{entry['prefill_worker_cpu_cores_lease_held']:.2f} with the lease held"
                + "".join(f"; over {backend} {entry[name]['median_gbps']:.2f} GB/s"
                          for name, backend in link_variants.items())
                + ("" if entry["lease_released"] else " [yellow](lease was gone at release)"))


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
