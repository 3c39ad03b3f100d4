"""The node store's index (transfer.node_store.index): what it holds, what it evicts, demotes
and promotes, and the events it records, driven step by step without I/O."""

from __future__ import annotations

import pytest

from transfer.node_store.events import EventLog, StoreEvent
from transfer.node_store.index import Admission, Demote, Drop, Promotion, Tier, TierIndex


def key(n: int) -> bytes:
    return n.to_bytes(16, "little")


def fill(index: TierIndex, *numbers: int, now: float = 0.0) -> list[Admission]:
    admissions = []
    for n in numbers:
        admission = index.admit(key(n), now)
        assert admission is not None
        index.set_checksum(key(n), n)
        admissions.append(admission)
    return admissions


def test_free_slots_go_lowest_first_and_nothing_moves():
    index = TierIndex(host_slots=3)
    assert [a.slot for a in fill(index, 1, 2, 3)] == [0, 1, 2]
    assert all(a.moves == () for a in fill(TierIndex(2), 7))
    assert index.num_blocks(Tier.HOST) == 3 and len(index) == 3


@pytest.mark.parametrize("keys, held, expected", [
    ([1, 2, 3], {1, 2, 3}, 3),
    ([1, 2, 3], {1, 3}, 1),   # a gap ends the run: later blocks cannot be used without it
    ([1, 2, 3], {2, 3}, 0),
    ([], {1}, 0),
])
def test_leading_counts_the_held_run_from_the_first(keys, held, expected):
    index = TierIndex(host_slots=4)
    fill(index, *sorted(held))
    assert index.leading([key(n) for n in keys]) == expected


def test_lacking_names_what_is_not_held_in_order():
    index = TierIndex(host_slots=4)
    fill(index, 2)
    assert index.lacking([key(1), key(2), key(3)]) == [key(1), key(3)]


def test_without_a_disk_tier_the_least_recently_used_block_is_dropped():
    index = TierIndex(host_slots=2)
    fill(index, 1, 2)
    index.leading([key(1)])  # 1 is now the most recently used
    admission = index.admit(key(3), now=0.0)
    assert admission == Admission(slot=1, moves=(Drop(key(2), Tier.HOST, 1),))
    assert key(2) not in index and key(1) in index


def test_a_pinned_block_is_not_evicted_until_its_deadline():
    index = TierIndex(host_slots=2)
    fill(index, 1, 2)
    index.pin([key(1)], until=5.0)
    assert index.admit(key(3), now=1.0).moves == (Drop(key(2), Tier.HOST, 1),)
    index.pin([key(3)], until=5.0)
    assert index.admit(key(4), now=2.0) is None  # everything pinned: no room, nothing changed
    assert key(4) not in index and len(index) == 2
    assert index.admit(key(4), now=5.0).moves == (Drop(key(1), Tier.HOST, 0),)


def test_host_eviction_demotes_to_disk_and_the_disk_drops_its_oldest():
    index = TierIndex(host_slots=1, disk_slots=2)
    fill(index, 1)
    assert index.admit(key(2), 0.0) == Admission(0, (Demote(key(1), host_slot=0, disk_slot=0),))
    assert index.admit(key(3), 0.0) == Admission(0, (Demote(key(2), 0, 1),))
    # The disk is full: its least recently used block goes before the next demotion.
    assert index.admit(key(4), 0.0) == Admission(0, (Drop(key(1), Tier.DISK, 0), Demote(key(3), 0, 0)))
    assert [index.entry(key(n)).tier for n in (2, 3, 4)] == [Tier.DISK, Tier.DISK, Tier.HOST]
    assert index.leading([key(2), key(3), key(4)]) == 3  # a disk block counts as held


def test_a_demoted_block_keeps_its_checksum_and_comes_back_on_promotion():
    index = TierIndex(host_slots=1, disk_slots=2)
    fill(index, 1, 2)  # 1 on disk slot 0, 2 on host slot 0
    promotion = index.promote(key(1), now=0.0)
    assert promotion == Promotion(host_slot=0, disk_slot=0, moves=(Demote(key(2), 0, 1),))
    assert index.entry(key(1)).tier is Tier.HOST and index.entry(key(1)).checksum == 1
    assert index.entry(key(2)).tier is Tier.DISK and index.entry(key(2)).checksum == 2
    # The promoted block's disk slot is free again once the store has read it.
    assert index.admit(key(3), 0.0).moves == (Demote(key(1), 0, 0),)


def test_a_promotion_never_evicts_the_block_it_promotes():
    index = TierIndex(host_slots=1, disk_slots=1)
    fill(index, 1, 2)  # 1 on the one disk slot, 2 on host
    promotion = index.promote(key(1), now=0.0)
    # The disk holds only the block being promoted: the host block is dropped, not demoted.
    assert promotion == Promotion(0, 0, (Drop(key(2), Tier.HOST, 0),))
    assert key(1) in index and key(2) not in index


def test_a_promotion_waits_when_every_host_block_is_pinned():
    index = TierIndex(host_slots=1, disk_slots=1)
    fill(index, 1, 2)
    index.pin([key(2)], until=9.0)
    assert index.promote(key(1), now=1.0) is None
    assert index.entry(key(1)).tier is Tier.DISK and index.leading([key(1)]) == 1


def test_only_a_disk_block_is_promoted_and_a_held_block_is_not_admitted_twice():
    index = TierIndex(host_slots=2)
    fill(index, 1)
    with pytest.raises(ValueError):
        index.promote(key(1), 0.0)
    with pytest.raises(KeyError):
        index.admit(key(1), 0.0)


def test_remove_frees_the_slot_and_clear_leaves_nothing_behind():
    index = TierIndex(host_slots=1, disk_slots=1)
    fill(index, 1, 2)
    assert index.remove(key(2)) == Drop(key(2), Tier.HOST, 0)
    assert index.remove(key(2)) is None
    assert index.admit(key(3), 0.0) == Admission(0, ())
    assert sorted(d.tier for d in index.clear()) == [Tier.DISK, Tier.HOST]
    assert len(index) == 0 and index.num_blocks(Tier.HOST) == index.num_blocks(Tier.DISK) == 0
    assert [a.slot for a in fill(index, 4)] == [0]


def test_events_record_every_block_stored_and_removed_once():
    index = TierIndex(host_slots=1, disk_slots=2)
    fill(index, 1, 2)
    index.promote(key(1), 0.0)
    epoch = index.events.epoch
    assert index.events.since(epoch, 0) == [
        StoreEvent("stored", key(1), Tier.HOST),
        StoreEvent("removed", key(1), Tier.HOST), StoreEvent("stored", key(1), Tier.DISK),
        StoreEvent("stored", key(2), Tier.HOST),
        StoreEvent("removed", key(2), Tier.HOST), StoreEvent("stored", key(2), Tier.DISK),  # room for 1
        StoreEvent("removed", key(1), Tier.DISK), StoreEvent("stored", key(1), Tier.HOST),
    ]
    assert index.events.seq == 8
    assert index.events.since(epoch, 6) == [StoreEvent("removed", key(1), Tier.DISK),
                                            StoreEvent("stored", key(1), Tier.HOST)]
    assert index.events.since(epoch, 8) == []
    assert sorted(index.holdings(), key=lambda e: e.key) == [StoreEvent("stored", key(1), "host"),
                                                              StoreEvent("stored", key(2), "disk")]


def test_a_reader_too_far_behind_or_of_another_run_needs_a_snapshot():
    log = EventLog(max_events=3)
    log.append(*(StoreEvent("stored", key(n), "host") for n in range(5)))
    assert log.seq == 5
    assert log.since(log.epoch, 2) == [StoreEvent("stored", key(n), "host") for n in (2, 3, 4)]
    assert log.since(log.epoch, 1) is None  # event 2 is no longer kept
    assert log.since("another-run", 5) is None
    assert log.since(log.epoch, 6) is None  # a reader ahead of the log: not one of its readers
    assert EventLog().epoch != log.epoch


@pytest.mark.parametrize("host, disk", [(0, 0), (-1, 2), (1, -1)])
def test_budgets_are_checked(host, disk):
    with pytest.raises(ValueError):
        TierIndex(host, disk)
