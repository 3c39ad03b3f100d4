"""The staging arena (transfer.staging_arena): regions carved out of one mapping, reused at the same
addresses once their lease ended and nothing holds them, and nothing left behind."""

from __future__ import annotations

import time

import torch

import transfer.staging_arena as staging_arena_module
from transfer.leases import Lease, LeaseTable
from transfer.staging_arena import ALIGNMENT, HUGE_PAGE_BYTES, StagingArena, huge_pages_offered, staging_arena


class FakeHold:
    def __init__(self):
        self.done = False


def test_regions_are_page_aligned_and_freed_runs_merge():
    arena = StagingArena(8 * ALIGNMENT)
    first, second, third = (arena.allocate(n) for n in (1, ALIGNMENT + 1, ALIGNMENT))
    assert [(r.offset, r.nbytes) for r in (first, second, third)] == [
        (0, ALIGNMENT), (ALIGNMENT, 2 * ALIGNMENT), (3 * ALIGNMENT, ALIGNMENT)]
    assert arena.allocate(5 * ALIGNMENT) is None  # 4 pages left
    first.close()
    third.close()
    second.close()  # joins both neighbours and the tail: one free run again
    assert arena.free_bytes == arena.nbytes
    assert arena.allocate(8 * ALIGNMENT).offset == 0


def test_an_ended_region_is_reused_at_the_same_address():
    arena = StagingArena(4 * ALIGNMENT)
    addresses = set()
    for _ in range(20):
        region = arena.allocate(2 * ALIGNMENT)
        addresses.add(region.tensor.data_ptr())
        region.close()
    assert addresses == {arena.address}


def test_a_held_region_outlives_its_lease_until_every_hold_is_done():
    arena = StagingArena(2 * ALIGNMENT)
    region = arena.allocate(2 * ALIGNMENT)
    pin, send = FakeHold(), FakeHold()
    region.hold(pin)
    region.hold(send)
    region.close()
    region.close()  # idempotent
    assert arena.allocate(ALIGNMENT) is None
    pin.done = True
    assert arena.allocate(ALIGNMENT) is None
    send.done = True
    assert arena.allocate(2 * ALIGNMENT).offset == 0


def test_the_region_tensor_is_the_arena_memory():
    arena = StagingArena(2 * ALIGNMENT)
    region = arena.allocate(100)
    region.tensor[:4] = torch.tensor([1, 2, 3, 4], dtype=torch.uint8)
    assert arena.tensor[region.offset:region.offset + 4].tolist() == [1, 2, 3, 4]


def test_a_lease_gives_its_region_back_when_it_ends():
    arena = StagingArena(4 * ALIGNMENT)
    table = LeaseTable()
    for end in ("release", "expire", "release while staging"):
        lease = Lease("h", "r", (1, 2), 32, expires_at=time.monotonic() - 1 if end == "expire" else 1e12)
        table.grant(lease, staging_bytes=ALIGNMENT)
        region = arena.allocate(ALIGNMENT)
        if end == "release while staging":
            table.release("h")
            assert table.finish_staging("h", (region.tensor,), region=region) is False
        else:
            table.finish_staging("h", (region.tensor,), region=region)
            assert table.get("h").region is region
            table.release("h") if end == "release" else table.expire(time.monotonic())
        assert arena.free_bytes == arena.nbytes, end
    assert len(table) == 0 and table.staged_bytes == 0


def test_one_arena_per_process_replaced_only_by_a_larger_one():
    arena = staging_arena(ALIGNMENT)
    assert staging_arena(ALIGNMENT) is arena
    larger = staging_arena(arena.nbytes + ALIGNMENT)
    assert larger is not arena and staging_arena(ALIGNMENT) is larger


def test_an_arena_only_nixl_reads_is_private_memory_on_a_huge_page_boundary():
    arena = StagingArena(3 * ALIGNMENT, shareable=False)
    assert not arena.shared and arena.file_ref(1) is None
    assert arena.address % HUGE_PAGE_BYTES == 0 and arena.tensor.numel() == arena.nbytes
    assert arena.huge_pages == huge_pages_offered()
    region = arena.allocate(ALIGNMENT)
    region.tensor.fill_(7)  # writable, and the region is no shared copy for a consumer to open
    assert region.shared_ref(1, pin=0) is None and int(arena.tensor[:ALIGNMENT].sum()) == 7 * ALIGNMENT


def test_the_shareable_and_the_private_arena_of_a_process_are_separate():
    shared, private = staging_arena(ALIGNMENT), staging_arena(ALIGNMENT, shareable=False)
    assert private is not shared and staging_arena(ALIGNMENT, shareable=False) is private
    assert staging_arena(ALIGNMENT) is shared and not private.shared


def test_huge_pages_are_offered_unless_the_kernel_says_never(tmp_path, monkeypatch):
    setting = tmp_path / "enabled"
    for text, offered in (("always [madvise] never\n", True), ("[always] madvise never\n", True),
                          ("always madvise [never]\n", False)):
        setting.write_text(text)
        monkeypatch.setattr(staging_arena_module, "THP_SETTING", str(setting))
        assert huge_pages_offered() is offered, text
    monkeypatch.setattr(staging_arena_module, "THP_SETTING", str(tmp_path / "missing"))
    assert huge_pages_offered() is False
