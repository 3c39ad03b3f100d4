"""The orchestrator's view of the node KV stores (orchestrator.tier_holdings): events and
snapshots applied per store, a restarted store's view replaced, and the run of a prompt's
blocks a store holds past a worker's own, by tier."""

from __future__ import annotations

from foundation import wire
from orchestrator.tier_holdings import NO_RUN, TierHoldings, TierRun

STORE = ("10.0.0.1", "tcp://127.0.0.1:7000")
OTHER = ("10.0.0.2", "tcp://127.0.0.1:7000")  # the same address on another host: another store
HASHES = [101, 102, 103, 104, 105]


def key(block: int) -> bytes:
    return block.to_bytes(16, "little")


def reply(*events: tuple[bool, str, int], seq: int, epoch: str = "run-1", snapshot: bool = False):
    return wire.TierEventsReply(epoch=epoch, seq=seq, snapshot=snapshot,
                                events=[wire.TierEvent(stored, tier, key(block)) for stored, tier, block in events])


def test_events_build_the_run_past_the_engine_blocks_by_tier():
    holdings = TierHoldings()
    holdings.apply(STORE, reply((True, "host", 101), (True, "host", 102), (True, "disk", 103), (True, "host", 105),
                                seq=4, snapshot=True))
    assert holdings.position(STORE) == ("run-1", 4)
    assert holdings.run(STORE, HASHES, 0) == TierRun(host_blocks=2, disk_blocks=1)  # 104 is missing: the run ends
    assert holdings.run(STORE, HASHES, 1) == TierRun(1, 1)
    assert holdings.run(STORE, HASHES, 3) == NO_RUN
    assert holdings.run(OTHER, HASHES, 0) == NO_RUN and holdings.run(None, HASHES, 0) == NO_RUN
    assert (holdings.num_blocks(STORE), holdings.num_blocks(STORE, "disk")) == (4, 1)


def test_a_demotion_and_a_removal_follow_in_order():
    holdings = TierHoldings()
    holdings.apply(STORE, reply((True, "host", 101), (True, "host", 102), seq=2, snapshot=True))
    # 101 moves to disk; 102 is dropped; a stale "removed from host" of 101 changes nothing.
    holdings.apply(STORE, reply((False, "host", 101), (True, "disk", 101), (False, "host", 102),
                                (False, "host", 101), seq=6))
    assert holdings.run(STORE, HASHES, 0) == TierRun(0, 1)
    assert holdings.position(STORE) == ("run-1", 6)


def test_a_snapshot_or_another_run_replaces_what_was_known():
    holdings = TierHoldings()
    holdings.apply(STORE, reply((True, "host", 101), (True, "host", 102), seq=2, snapshot=True))
    holdings.apply(STORE, reply((True, "host", 103), seq=1, epoch="run-2"))  # the store restarted
    assert holdings.run(STORE, [103], 0) == TierRun(1, 0) and holdings.run(STORE, HASHES, 0) == NO_RUN
    holdings.apply(STORE, reply((True, "disk", 101), seq=9, epoch="run-2", snapshot=True))
    assert holdings.num_blocks(STORE) == 1 and holdings.run(STORE, HASHES, 0) == TierRun(0, 1)


def test_a_forgotten_store_holds_nothing_and_is_asked_from_the_start():
    holdings = TierHoldings()
    holdings.apply(STORE, reply((True, "host", 101), seq=1, snapshot=True))
    holdings.forget(STORE)
    assert holdings.run(STORE, HASHES, 0) == NO_RUN
    assert holdings.position(STORE) == ("", 0) and holdings.stores() == []


def test_reach_adds_the_store_run_past_each_start():
    holdings = TierHoldings()
    holdings.apply(STORE, reply((True, "host", 101), (True, "host", 102), (True, "disk", 104), seq=3, snapshot=True))
    reach = holdings.reach(HASHES)
    assert [reach(STORE, start) for start in (0, 1, 2, 3, 4)] == [2, 2, 2, 4, 4]
    assert reach(OTHER, 3) == 3 and reach(None, 1) == 1
