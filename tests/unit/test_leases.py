"""LeaseTable: every lease ends exactly once, by release or expiry, and reports its
request id exactly once."""

from __future__ import annotations

import threading

import pytest
import torch

from transfer.leases import Lease, LeaseTable


def lease(handle: str, request_id: str | None = None, expires_at: float = 100.0, blocks=(1, 2, 3)) -> Lease:
    return Lease(handle=handle, request_id=request_id or f"req-{handle}", block_ids=tuple(blocks),
                 num_tokens=len(blocks) * 16, expires_at=expires_at)


def assert_nothing_left_behind(table: LeaseTable) -> None:
    assert len(table) == 0
    assert table.take_ended_request_ids() == set()


def test_grant_then_get():
    table = LeaseTable()
    granted = lease("h1", blocks=(7, 3, 9))
    table.grant(granted)
    assert len(table) == 1
    assert table.get("h1") is granted
    assert table.get("h1").block_ids == (7, 3, 9)
    assert table.get("other") is None
    assert table.num_granted == 1
    # Nothing ended yet.
    assert table.take_ended_request_ids() == set()
    assert table.release("h1")
    assert table.take_ended_request_ids() == {"req-h1"}
    assert_nothing_left_behind(table)


def test_release_once():
    table = LeaseTable()
    table.grant(lease("h1", "req-a"))
    assert table.release("h1") is True
    assert table.release("h1") is False
    assert table.get("h1") is None
    assert table.num_released == 1
    assert table.take_ended_request_ids() == {"req-a"}
    assert table.take_ended_request_ids() == set()
    assert_nothing_left_behind(table)


def test_release_unknown_handle():
    table = LeaseTable()
    table.grant(lease("h1"))
    assert table.release("nope") is False
    assert table.num_released == 0
    assert len(table) == 1
    assert table.take_ended_request_ids() == set()
    table.release("h1")
    table.take_ended_request_ids()
    assert_nothing_left_behind(table)


def test_expire_by_time():
    table = LeaseTable()
    table.grant(lease("early", "req-early", expires_at=10.0))
    table.grant(lease("exact", "req-exact", expires_at=20.0))
    table.grant(lease("late", "req-late", expires_at=30.0))

    assert table.expire(now=5.0) == []
    assert len(table) == 3

    expired = table.expire(now=20.0)  # the deadline itself counts as passed
    assert sorted(lease.handle for lease in expired) == ["early", "exact"]
    assert table.num_expired == 2
    assert table.get("early") is None and table.get("exact") is None
    assert table.get("late") is not None
    assert table.take_ended_request_ids() == {"req-early", "req-exact"}

    # An expired lease can no longer be released, and expiring again finds nothing.
    assert table.release("early") is False
    assert table.expire(now=20.0) == []
    assert table.num_expired == 2

    assert [lease.handle for lease in table.expire(now=1e9)] == ["late"]
    assert table.take_ended_request_ids() == {"req-late"}
    assert table.num_expired == 3
    assert table.num_released == 0
    assert_nothing_left_behind(table)


def test_release_then_expire_reports_the_request_once():
    table = LeaseTable()
    table.grant(lease("h1", "req-a", expires_at=1.0))
    assert table.release("h1")
    assert table.expire(now=2.0) == []
    assert table.take_ended_request_ids() == {"req-a"}
    assert table.num_released == 1 and table.num_expired == 0
    assert_nothing_left_behind(table)


def test_take_ended_request_ids_returns_each_id_once():
    table = LeaseTable()
    for i in range(5):
        table.grant(lease(f"h{i}", f"req-{i}", expires_at=float(i)))
    table.release("h0")
    table.release("h1")
    first = table.take_ended_request_ids()
    assert first == {"req-0", "req-1"}
    table.expire(now=3.0)  # h2, h3
    second = table.take_ended_request_ids()
    assert second == {"req-2", "req-3"}
    assert first.isdisjoint(second)
    table.release("h4")
    assert table.take_ended_request_ids() == {"req-4"}
    assert table.take_ended_request_ids() == set()
    assert (table.num_granted, table.num_released, table.num_expired) == (5, 3, 2)
    assert_nothing_left_behind(table)


def test_taken_set_is_not_aliased_to_the_table():
    table = LeaseTable()
    table.grant(lease("h1", "req-a"))
    table.release("h1")
    taken = table.take_ended_request_ids()
    table.grant(lease("h2", "req-b"))
    table.release("h2")
    assert taken == {"req-a"}  # later ends do not leak into an already returned set
    assert table.take_ended_request_ids() == {"req-b"}
    assert_nothing_left_behind(table)


def test_counters_track_the_lifecycle():
    table = LeaseTable()
    assert (table.num_granted, table.num_released, table.num_expired, len(table)) == (0, 0, 0, 0)
    table.grant(lease("a", expires_at=1.0))
    table.grant(lease("b", expires_at=1.0))
    table.grant(lease("c", expires_at=99.0))
    assert (table.num_granted, len(table)) == (3, 3)
    table.release("c")
    table.expire(now=1.0)
    assert (table.num_granted, table.num_released, table.num_expired, len(table)) == (3, 1, 2, 0)
    assert table.take_ended_request_ids() == {"req-a", "req-b", "req-c"}
    assert_nothing_left_behind(table)


@pytest.mark.timeout(30)
def test_concurrent_release_and_expire_end_each_lease_exactly_once():
    """The block server thread releases while the engine thread expires."""
    table = LeaseTable()
    handles = [f"h{i}" for i in range(2000)]
    for handle in handles:
        table.grant(lease(handle, expires_at=0.0))
    released: list[bool] = []
    expired: list[Lease] = []
    start = threading.Barrier(2)

    def releaser():
        start.wait()
        released.extend(table.release(handle) for handle in handles)

    def expirer():
        start.wait()
        for _ in range(50):
            expired.extend(table.expire(now=1.0))

    threads = [threading.Thread(target=releaser), threading.Thread(target=expirer)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()

    assert sum(released) + len(expired) == len(handles)
    assert table.num_released + table.num_expired == len(handles)
    assert table.take_ended_request_ids() == {f"req-{h}" for h in handles}
    assert_nothing_left_behind(table)


# ---------------------------------------------------------------- staging


def staged_layers(nbytes_each: int = 8, count: int = 2) -> tuple[torch.Tensor, ...]:
    return tuple(torch.zeros(nbytes_each, dtype=torch.uint8) for _ in range(count))


def test_staging_lease_is_not_servable_until_the_copy_is_done():
    table = LeaseTable()
    table.grant(lease("h1", "req-a"), staging_bytes=16)
    assert table.get("h1") is None
    assert table.staged_bytes == 16
    assert table.take_ended_request_ids() == set()  # the copy still reads the engine's blocks
    assert table.finish_staging("h1", staged_layers())
    served = table.get("h1")
    assert served is not None and len(served.staged) == 2
    # Staged: the engine may free its blocks now, although the lease lives on.
    assert table.take_ended_request_ids() == {"req-a"}
    assert table.num_staged == 1 and len(table) == 1


def test_releasing_a_staged_lease_frees_its_budget_and_reports_nothing_twice():
    table = LeaseTable()
    table.grant(lease("h1", "req-a"), staging_bytes=16)
    table.finish_staging("h1", staged_layers())
    table.take_ended_request_ids()
    assert table.release("h1")
    assert table.take_ended_request_ids() == set()
    assert table.staged_bytes == 0 and len(table) == 0


def test_release_during_the_copy_is_reported_when_the_copy_stops():
    table = LeaseTable()
    table.grant(lease("h1", "req-a"), staging_bytes=16)
    assert table.release("h1")
    assert table.take_ended_request_ids() == set()  # freeing now would race the copy
    assert table.finish_staging("h1", staged_layers()) is False
    assert table.take_ended_request_ids() == {"req-a"}
    assert table.staged_bytes == 0 and table.get("h1") is None


def test_expiry_during_the_copy_waits_for_it_too():
    table = LeaseTable()
    table.grant(lease("h1", "req-a", expires_at=5.0), staging_bytes=16)
    assert [ended.handle for ended in table.expire(now=6.0)] == ["h1"]
    assert table.take_ended_request_ids() == set()
    table.finish_staging("h1", None)
    assert table.take_ended_request_ids() == {"req-a"}
    assert table.staged_bytes == 0


def test_failed_copy_leaves_the_lease_in_place():
    table = LeaseTable()
    table.grant(lease("h1", "req-a"), staging_bytes=16)
    assert table.finish_staging("h1", None)
    in_place = table.get("h1")
    assert in_place is not None and in_place.staged is None
    assert table.staged_bytes == 0
    assert table.take_ended_request_ids() == set()  # still holding the engine's blocks
    table.release("h1")
    assert table.take_ended_request_ids() == {"req-a"}


def test_release_all_covers_every_state():
    table = LeaseTable()
    table.grant(lease("in-place", "req-1"))
    table.grant(lease("staging", "req-2"), staging_bytes=8)
    table.grant(lease("staged", "req-3"), staging_bytes=8)
    table.finish_staging("staged", staged_layers(4))
    assert table.take_ended_request_ids() == {"req-3"}
    assert table.release_all() == 3
    assert table.take_ended_request_ids() == {"req-1"}
    table.finish_staging("staging", staged_layers(4))
    assert table.take_ended_request_ids() == {"req-2"}
    assert table.staged_bytes == 0 and len(table) == 0


def test_expired_handles_are_remembered_and_released_ones_are_not(monkeypatch):
    monkeypatch.setattr("transfer.leases.REMEMBERED_EXPIRED_HANDLES", 2)
    table = LeaseTable()
    for handle in ("old", "mid", "new"):
        table.grant(lease(handle, expires_at=1.0))
    table.grant(lease("released", expires_at=1.0))
    assert table.release("released")
    assert not table.has_expired("old")  # live until it expires
    table.expire(now=1.0)
    # The most recent few are remembered; which of a batch counts as most recent is not pinned.
    assert sum(table.has_expired(h) for h in ("old", "mid", "new")) == 2
    assert not table.has_expired("released") and not table.has_expired("never-granted")
    table.take_ended_request_ids()
    assert_nothing_left_behind(table)
