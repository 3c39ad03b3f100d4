"""The into-cache phase of ``kvroute bench transfer``: one staged lease pulled into a paged
cache by each path a consumer on this host has, from the same producer process.

::

    this process (consumer: paged cache, pulls)      producer process (BlockServer, leases)
        ── stage(path's arena, blocks) ────────────▶  copies blocks into that staging arena
        ◀─ PullSource ─────────────────────────────
        timed: the pull, as the connector makes it, until the blocks lie in the cache
        ── release(handle) ────────────────────────▶  (the consumer's acknowledgement)

Paths (``PATHS``): ``direct``, NIXL READs of the lease in the producer's staging arena
straight into the cache rows (``transfer.direct_reads``); ``shared``, ``preadv`` of the
lease's region of the arena's memfd, then its confirmation (``transfer.shared_copies``);
``nixl-link``, the lease's frames over a nixl link, READ into the link's buffer and
scattered; ``frames``, the lease's frames on the endpoint's connection, scattered. The
producer stages as the connector does (``transfer.connector_worker``): for the NIXL paths
into the arena of a producer that forces nixl (private memory in huge pages), for the others
into the arena consumers open as a file. A fresh lease per pull, so nothing is cached between
pulls; the destination blocks are scattered as an allocator hands them out. One warm-up
per path and size (it also opens the link and loads the NIXL peer), whose blocks are
checked against the producer's pattern; then the repetitions, the paths' order rotating so
drift hits all alike; medians.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
from collections.abc import Callable

import torch

from foundation import cluster_keys, zmq_auth

PATHS = ("direct", "shared", "nixl-link", "frames")
NIXL_PATHS = ("direct", "nixl-link")
SHAREABLE = {path: path not in NIXL_PATHS for path in PATHS}  # the path's arena (see the docstring)
BLOCK_TOKENS = 128  # a vLLM CPU block
DEADLINE_SECONDS = 60.0


def paged_layers(bytes_per_token: int, num_layers: int, min_blocks: int) -> list[torch.Tensor]:
    """vLLM's CPU layout in bytes: per layer (keys and values, blocks, tokens, a token's half),
    with at least ``min_blocks`` blocks, as many as no other dimension has."""
    shape = [2, min_blocks, BLOCK_TOKENS, bytes_per_token // num_layers // 2]
    while shape[1] in shape[:1] + shape[2:]:
        shape[1] += 1
    return [torch.zeros(shape, dtype=torch.uint8) for _ in range(num_layers)]


def pattern(layer: int, lead: int, block: int) -> int:
    """The byte every row of a producer block holds, for the consumer to check what it pulled."""
    return (layer * 31 + lead * 101 + block * 7) % 251


def producer_main(connection, keys_folder: str, bytes_per_token: int, num_layers: int, num_blocks: int) -> None:
    from foundation.netutil import free_port, tcp
    from transfer.block_server import BlockServer
    from transfer.counters import Counters
    from transfer.kv_layout import PagedKVCache, block_index_tensor
    from transfer.leases import Lease, LeaseTable
    from transfer.staging_arena import stage_in_arena, staging_arena
    from transfer.transports.settings import TransportSettings

    zmq_auth.configure(cluster_keys.load(keys_folder), "worker", True)
    layers = paged_layers(bytes_per_token, num_layers, num_blocks)
    num_blocks = layers[0].shape[1]
    for index, layer in enumerate(layers):
        for lead in range(2):
            for block in range(num_blocks):
                layer[lead, block].fill_(pattern(index, lead, block))
    cache, leases = PagedKVCache(layers, num_blocks, BLOCK_TOKENS), LeaseTable()
    address = tcp("127.0.0.1", free_port())
    server = BlockServer(address, cache, leases, Counters(), link_settings=TransportSettings(backend="nixl"))
    server.start()
    arenas = {shareable: staging_arena(num_blocks * cache.spec.bytes_per_block, shareable)
              for shareable in (True, False)}
    connection.send(address)
    for serial, (op, *args) in enumerate(iter(connection.recv, ("stop",))):
        if op == "stage":
            shareable, count = args
            block_ids = block_index_tensor(range(count))
            lease = Lease(f"lease-{serial}", f"request-{serial}", tuple(range(count)), count * BLOCK_TOKENS,
                          time.monotonic() + DEADLINE_SECONDS)
            leases.grant(lease, staging_bytes=count * cache.spec.bytes_per_block)
            layers, region = stage_in_arena(cache, block_ids, arenas[shareable])
            leases.finish_staging(lease.handle, layers, region=region)
            connection.send(lease.handle)
        else:
            leases.release(args[0])
    server.stop()


class Consumer:
    """This process's end: a paged cache, and the pull of each path into it."""

    def __init__(self, address: str, bytes_per_token: int, num_layers: int, num_blocks: int):
        import zmq

        from transfer.direct_reads import DirectReader
        from transfer.kv_layout import PagedKVCache

        self.address = address
        layers = paged_layers(bytes_per_token, num_layers, num_blocks)
        self.cache = PagedKVCache(layers, layers[0].shape[1], BLOCK_TOKENS)
        self.context = zmq.Context.instance()
        self.reader = DirectReader(self.cache, "127.0.0.1")
        self._link = None

    def pull(self, path: str, handle: str, positions: list[int], local_ids: list[int]) -> None:
        from foundation.wire import PullSource
        from transfer.block_client import pull_blocks
        from transfer.kv_layout import block_index_tensor
        from transfer.link_control import pull_over_link
        from transfer.shared_copies import read_shared_copy

        cache, deadline = self.cache, time.monotonic() + DEADLINE_SECONDS
        source = PullSource(handle=handle, address=self.address, num_tokens=len(positions) * BLOCK_TOKENS,
                            block_size=BLOCK_TOKENS)
        local = block_index_tensor(local_ids)
        store = lambda layer, data: cache.scatter_layer(layer, local, data)  # noqa: E731
        if path == "direct":
            read = lambda ref: self.reader.read(ref, local_ids, positions, deadline)  # noqa: E731
            pull_blocks(self.context, source, positions, cache.spec, store, deadline, read_direct=read)
        elif path == "shared":
            read = lambda ref: read_shared_copy(ref, cache, local_ids, positions)  # noqa: E731
            pull_blocks(self.context, source, positions, cache.spec, store, deadline, read_shared=read)
        elif path == "nixl-link":
            pull_over_link(self.context, source, positions, cache.spec, self._nixl_link(), store, deadline)
        else:
            pull_blocks(self.context, source, positions, cache.spec, store, deadline)

    def _nixl_link(self):
        from transfer.link_control import open_consumer_link
        from transfer.transports.settings import TransportSettings

        if self._link is None or self._link.closed:
            self._link = open_consumer_link(self.context, self.address, self.cache.spec, self.cache.device,
                                            TransportSettings(backend="nixl"))
        return self._link

    def check(self, positions: list[int], local_ids: list[int]) -> None:
        for index, layer in enumerate(self.cache.layers):
            for position, block in zip(positions, local_ids):
                for lead in range(2):
                    if not bool((layer[lead, block] == pattern(index, lead, position)).all()):
                        raise AssertionError(f"layer {index}: block {block} does not hold position {position}")

    def close(self) -> None:
        if self._link is not None:
            self._link.close()
        self.reader.close()


def measure_into_cache(keys_folder: str, bytes_per_token: int, num_layers: int, lengths: list[int], reps: int,
                       paths: tuple[str, ...], on_row: Callable[[dict], None]) -> None:
    """Time ``paths`` per prompt length (whole blocks); ``on_row`` sees each row when measured."""
    from kvroute.bench.transfer_raw import destination_blocks

    max_blocks = max(tokens // BLOCK_TOKENS for tokens in lengths)
    spawn = multiprocessing.get_context("spawn")
    connection, peer = spawn.Pipe()
    producer = spawn.Process(target=producer_main, args=(peer, keys_folder, bytes_per_token, num_layers, max_blocks),
                             name="kvroute-bench-producer", daemon=True)
    producer.start()
    zmq_auth.configure(cluster_keys.load(keys_folder), "worker", True)
    consumer = Consumer(connection.recv(), bytes_per_token, num_layers, 2 * max_blocks + 1)
    try:
        for tokens in lengths:
            count = tokens // BLOCK_TOKENS
            positions, local_ids = list(range(count)), destination_blocks(consumer.cache.num_blocks, count, tokens)
            samples = {path: [] for path in paths}
            for rep in range(reps + 1):
                for path in paths[rep % len(paths):] + paths[:rep % len(paths)]:
                    connection.send(("stage", SHAREABLE[path], count))
                    handle = connection.recv()
                    started = time.perf_counter()
                    consumer.pull(path, handle, positions, local_ids)
                    elapsed = time.perf_counter() - started
                    connection.send(("release", handle))
                    if rep == 0:
                        consumer.check(positions, local_ids)  # the warm-up: checked, not timed
                    else:
                        samples[path].append(elapsed)
            for path in paths:
                on_row({"path": path, "prompt_tokens": tokens, "bytes": count * BLOCK_TOKENS * bytes_per_token,
                        "seconds": statistics.median(samples[path]), "samples": samples[path]})
    finally:
        consumer.close()
        connection.send(("stop",))
        producer.join(10)
        if producer.is_alive():
            producer.kill()
