"""The node store's protocol over real sockets (transfer.node_store): blocks put from one
paged cache come back bit-exact into another, from shared memory or as frames; a block is
written once; the least recently used go first, to disk when there is a disk tier and back
from it; a corrupted or truncated block is refused; tenants' blocks never meet; a store that
is gone costs a lookup its short timeout and then nothing."""

from __future__ import annotations

import os
import time

import pytest
import torch

from foundation import identity, wire
from foundation.netutil import free_port, tcp
from tests.paged_caches import CONSUMER_BLOCKS, DTYPES, LAYOUTS, NUM_LAYERS, block_bytes, make_cache
from transfer.memfd import local_host
from transfer.node_store.cache_io import TierBlockRefused, read_blocks, stage_for_put
from transfer.node_store.client import NodeStoreClient, StoreRefused, StoreUnavailable
from transfer.node_store.server import NodeStoreServer
from transfer.node_store.settings import GIB, NodeStoreSettings

pytestmark = pytest.mark.timeout(60)
PRODUCER_BLOCKS = 12


def keys(*numbers: int) -> list[bytes]:
    return [n.to_bytes(16, "little") for n in numbers]


@pytest.fixture(params=list(LAYOUTS))
def layout(request):
    return request.param


@pytest.fixture
def caches(layout):
    """(a cache that writes blocks through, an empty one that loads them back)."""
    return (make_cache(DTYPES["bfloat16"], layout, PRODUCER_BLOCKS, seed=3),
            make_cache(DTYPES["bfloat16"], layout, CONSUMER_BLOCKS, seed=None))


def settings_for(cache, host_blocks: int, disk_blocks: int = 0, disk_dir=None) -> NodeStoreSettings:
    """A store with room for exactly so many blocks of ``cache``'s layout."""
    size = cache.spec.bytes_per_block
    return NodeStoreSettings(bind=tcp("127.0.0.1", free_port()), host_kv_gib=(host_blocks * size + 1) / GIB,
                             disk_kv_gib=(disk_blocks * size + 1) / GIB if disk_blocks else 0.0,
                             disk_kv_dir=str(disk_dir) if disk_blocks else "")


@pytest.fixture
def serve(context):
    servers = []

    def start(settings: NodeStoreSettings) -> tuple[NodeStoreServer, NodeStoreClient]:
        server = NodeStoreServer(settings, context).start()
        client = NodeStoreClient(settings.bind, context)
        servers.append((server, client))
        return server, client
    yield start
    for server, client in servers:
        client.close()
        server.stop()


def put(client: NodeStoreClient, cache, block_keys: list[bytes], block_ids: list[int], shared: bool = True):
    copy = stage_for_put(cache, block_ids)
    try:
        return client.put(block_keys, cache.spec, copy.ref(len(block_ids)) if shared else None,
                          memoryview(copy.mapping))
    finally:
        copy.close()


def load(client: NodeStoreClient, cache, block_keys: list[bytes], local_ids: list[int], shared: bool = True) -> int:
    reply, frames = client.get(block_keys, cache.spec, local_host() if shared else "")
    assert bool(reply.arenas) == shared
    return read_blocks(reply, frames, cache, local_ids)


def assert_same_blocks(source, source_ids, target, target_ids) -> None:
    for layer in range(NUM_LAYERS):
        for source_id, target_id in zip(source_ids, target_ids):
            assert torch.equal(block_bytes(target, layer, target_id), block_bytes(source, layer, source_id))


@pytest.mark.parametrize("shared", [True, False], ids=["shared-memory", "frames"])
def test_blocks_come_back_bit_exact(serve, caches, shared):
    writer, reader = caches
    _, client = serve(settings_for(writer, host_blocks=8))
    assert put(client, writer, keys(1, 2, 3), [5, 0, 9], shared) == wire.TierPutReply(stored=3)
    assert client.leading(keys(1, 2, 3, 4)) == 3
    assert load(client, reader, keys(1, 2, 3), [2, 7, 4], shared) == 3 * writer.spec.bytes_per_block
    assert_same_blocks(writer, [5, 0, 9], reader, [2, 7, 4])
    counters = client.stats().counters
    assert (counters.blocks_stored, counters.blocks_served, counters.host_blocks) == (3, 3, 3)


def test_a_block_already_held_is_not_written_again(serve, caches):
    writer, _ = caches
    _, client = serve(settings_for(writer, host_blocks=8))
    put(client, writer, keys(1, 2), [0, 1])
    assert put(client, writer, keys(1, 2, 3), [0, 1, 2]) == wire.TierPutReply(stored=1, present=2)
    assert client.stats().counters.host_blocks == 3


def test_lookups_count_the_held_run_from_the_first_block(serve, caches):
    writer, _ = caches
    _, client = serve(settings_for(writer, host_blocks=8))
    put(client, writer, keys(1, 2, 4), [0, 1, 2])
    assert [client.leading(keys(*run)) for run in ([1, 2, 3, 4], [2], [3, 4], [])] == [2, 1, 0, 0]


def test_lookups_count_blocks_asked_and_found(serve, caches):
    writer, _ = caches
    _, client = serve(settings_for(writer, host_blocks=8))
    put(client, writer, keys(1, 2), [0, 1])
    client.leading(keys(1, 2, 3))
    client.leading(keys(5))
    counters = client.stats().counters
    assert (counters.lookups, counters.lookup_blocks, counters.lookup_hits) == (2, 4, 2)


def test_a_reset_empties_every_tier_and_the_store_fills_again(serve, caches, tmp_path):
    writer, reader = caches
    _, client = serve(settings_for(writer, host_blocks=2, disk_blocks=4, disk_dir=tmp_path))
    put(client, writer, keys(1, 2, 3), [0, 1, 2])  # 1 on disk, 2 and 3 in host memory
    assert client.reset() == wire.TierResetReply(blocks_dropped=3)
    assert client.leading(keys(1)) == client.leading(keys(3)) == 0
    assert not list((tmp_path / "kvroute-node-store").glob("*.blk")), "a reset leaves no block on disk"
    counters = client.stats().counters
    assert (counters.host_blocks, counters.disk_blocks, counters.resets) == (0, 0, 1)
    put(client, writer, keys(3), [2])
    assert load(client, reader, keys(3), [0]) == writer.spec.bytes_per_block
    assert_same_blocks(writer, [2], reader, [0])


def test_its_events_tell_a_reader_every_block_stored_moved_and_dropped(serve, caches, tmp_path):
    writer, _ = caches
    _, client = serve(settings_for(writer, host_blocks=2, disk_blocks=4, disk_dir=tmp_path))
    assert client.events(0, "") == wire.TierEventsReply(snapshot=True), "nothing stored yet"
    put(client, writer, keys(1, 2), [0, 1])
    first = client.events(0, "")
    held = {event.key: event.tier for event in first.events}
    assert first.snapshot and held == {keys(1)[0]: "host", keys(2)[0]: "host"}
    put(client, writer, keys(3), [2])  # 1 goes to disk
    moved = client.events(first.seq, first.epoch)
    assert not moved.snapshot and moved.seq == first.seq + 3
    assert [(e.stored, e.tier, e.key) for e in moved.events] == [
        (False, "host", keys(1)[0]), (True, "disk", keys(1)[0]), (True, "host", keys(3)[0])]
    client.reset()
    dropped = client.events(moved.seq, moved.epoch)
    assert sorted((e.stored, e.tier) for e in dropped.events) == [(False, "disk"), (False, "host"), (False, "host")]
    assert client.events(dropped.seq, "another run").snapshot, "a reader of another run gets a snapshot"


def test_without_a_disk_tier_the_least_recently_used_blocks_go(serve, caches):
    writer, _ = caches
    _, client = serve(settings_for(writer, host_blocks=2))
    put(client, writer, keys(1, 2), [0, 1])
    assert client.leading(keys(1)) == 1  # 1 is now the most recently used
    put(client, writer, keys(3), [2])
    assert (client.leading(keys(1)), client.leading(keys(2)), client.leading(keys(3))) == (1, 0, 1)
    assert client.stats().counters.dropped == 1


def test_a_disk_round_trip(serve, caches, tmp_path):
    writer, reader = caches
    server, client = serve(settings_for(writer, host_blocks=2, disk_blocks=4, disk_dir=tmp_path))
    put(client, writer, keys(1, 2, 3, 4), [3, 4, 5, 6])  # 1 and 2 go to disk as 3 and 4 arrive
    files = list((tmp_path / "kvroute-node-store").glob("*.blk"))
    assert len(files) == 2
    assert {oct(f.stat().st_mode & 0o777) for f in files} == {"0o600"}, "every tenant's KV: the store's user alone"
    assert (tmp_path / "kvroute-node-store").stat().st_mode & 0o777 == 0o700
    assert client.leading(keys(1, 2, 3, 4)) == 4
    assert load(client, reader, keys(1, 2), [0, 1]) == 2 * writer.spec.bytes_per_block
    assert_same_blocks(writer, [3, 4], reader, [0, 1])
    counters = client.stats().counters
    assert (counters.demotions, counters.promotions, counters.host_blocks, counters.disk_blocks) == (4, 2, 2, 2)
    server.stop()
    assert not list((tmp_path / "kvroute-node-store").glob("*.blk")), "a stopped store leaves its disk folder empty"


def test_a_read_whose_promotions_drop_its_own_disk_blocks_is_refused_and_the_store_serves_on(serve, caches,
                                                                                           tmp_path):
    writer, reader = caches
    _, client = serve(settings_for(writer, host_blocks=1, disk_blocks=2, disk_dir=tmp_path))
    put(client, writer, keys(1, 2, 3), [0, 1, 2])  # 3 in host memory, 1 and 2 on a full disk tier
    with pytest.raises(StoreRefused, match="disk tier is too small"):
        load(client, reader, keys(1, 2), [0, 1])  # bringing 1 back demotes 3, which drops 2
    assert load(client, reader, keys(1), [0]) == writer.spec.bytes_per_block
    assert_same_blocks(writer, [0], reader, [0])


def test_a_get_needing_more_host_room_than_is_unpinned_is_refused(serve, caches, tmp_path):
    writer, reader = caches
    _, client = serve(settings_for(writer, host_blocks=2, disk_blocks=4, disk_dir=tmp_path))
    put(client, writer, keys(1, 2, 3), [0, 1, 2])
    with pytest.raises(StoreRefused, match="pinned"):
        client.get(keys(1, 2, 3), writer.spec, local_host())


def test_a_corrupted_host_block_is_refused_by_its_reader(serve, caches):
    writer, reader = caches
    server, client = serve(settings_for(writer, host_blocks=4))
    put(client, writer, keys(1, 2), [0, 1])
    server.store.arenas.slot(server.store.index.entry(keys(2)[0]).slot)[100] ^= 0xFF
    for shared in (True, False):
        with pytest.raises(TierBlockRefused, match="checksum"):
            load(client, reader, keys(1, 2), [0, 1], shared)


def test_a_truncated_disk_block_is_refused_and_forgotten(serve, caches, tmp_path):
    writer, reader = caches
    _, client = serve(settings_for(writer, host_blocks=1, disk_blocks=2, disk_dir=tmp_path))
    put(client, writer, keys(1, 2), [0, 1])  # 1 on disk
    (block_file,) = (tmp_path / "kvroute-node-store").glob("*.blk")
    os.truncate(block_file, 10)
    with pytest.raises(StoreRefused, match="disk block"):
        client.get(keys(1), writer.spec, local_host())
    assert client.leading(keys(1)) == 0 and client.stats().counters.corrupt_blocks == 1
    assert load(client, reader, keys(2), [0]) == writer.spec.bytes_per_block  # the store serves on


def test_tenants_never_share_blocks(serve, caches):
    writer, _ = caches
    _, client = serve(settings_for(writer, host_blocks=8))
    tokens = list(range(3 * 16))
    tenant_a, tenant_b = (identity.Namespace("model", tenant=name).cache_salt(b"cluster secret") for name in "ab")
    hashes = {salt: [h.to_bytes(16, "little") for h in identity.block_hashes(tokens, 16, salt)]
              for salt in (tenant_a, tenant_b)}
    put(client, writer, hashes[tenant_a], [0, 1, 2])
    assert client.leading(hashes[tenant_a]) == 3
    assert client.leading(hashes[tenant_b]) == 0
    with pytest.raises(StoreRefused, match="not held"):
        client.get(hashes[tenant_b], writer.spec, local_host())


def test_a_copy_the_store_cannot_open_is_sent_as_a_frame(serve, caches):
    writer, reader = caches
    _, client = serve(settings_for(writer, host_blocks=4))
    copy = stage_for_put(writer, [4])
    unreachable = wire.SharedCopyRef(pid=os.getpid(), fd=copy.fd, name=copy.name + "x", num_blocks=1)
    assert client.put(keys(1), writer.spec, unreachable, memoryview(copy.mapping)).stored == 1
    copy.close()
    load(client, reader, keys(1), [3])
    assert_same_blocks(writer, [4], reader, [3])


def test_requests_it_will_not_serve_are_refused_and_it_serves_on(serve, caches):
    writer, _ = caches
    _, client = serve(settings_for(writer, host_blocks=4))
    put(client, writer, keys(1), [0])
    other = wire.KVLayoutSpec(**{**wire.to_dict(writer.spec), "dtype": "float32"})
    with pytest.raises(StoreRefused, match="another KV layout"):
        client.put(keys(2), other, None, memoryview(bytes(writer.spec.bytes_per_block)))
    with pytest.raises(StoreRefused, match="16 bytes"):
        client.get([b"short"], writer.spec, "")
    with pytest.raises(StoreRefused, match="frame"):
        client.put(keys(3), writer.spec, None, memoryview(b"too short"))
    assert client.leading(keys(1)) == 1


def test_a_store_that_is_gone_costs_one_short_wait(context):
    client = NodeStoreClient(tcp("127.0.0.1", free_port()), context, lookup_timeout=0.05, backoff_seconds=30)
    started = time.monotonic()
    assert client.leading(keys(1)) == 0
    first = time.monotonic() - started
    assert 0.04 < first < 1.0
    started = time.monotonic()
    assert client.leading(keys(1)) == 0 and not client.available
    with pytest.raises(StoreUnavailable):
        client.get(keys(1), wire.KVLayoutSpec("bfloat16", 1, 0, [1], 16, 2), "")
    assert time.monotonic() - started < 0.01, "left alone: later calls do not wait"
    client.close()
