"""PrefixIndex built from vLLM-shaped KV events (``tests.fake_engine``); ResidentBlocks
snapshots agree with it."""

from __future__ import annotations

import random

import pytest

from foundation import kv_events, wire
from foundation.identity import Namespace, block_hashes
from foundation.kv_events import AllBlocksCleared, BlockRemoved, KVEventBatch
from orchestrator.index import PrefixIndex
from orchestrator.index_sync import snapshot_records
from tests.fake_engine import BS, LORA, MODEL, OTHER_TENANT, S_LORA, FakeEngine, S, tokens
from worker.resident import ResidentBlocks


def match(index: PrefixIndex, toks: list[int], salt: str | None) -> dict[str, int]:
    return index.match(block_hashes(toks, BS, salt))


def fresh(*workers: str) -> PrefixIndex:
    index = PrefixIndex()
    for worker in workers:
        index.reset_worker(worker, f"{worker}-inc1")
    return index


# ---------------------------------------------------------------- longest-prefix match


@pytest.mark.parametrize("int_hashes", [False, True])
def test_three_block_chain_matches_three_two_and_zero(int_hashes):
    engine = FakeEngine(1, int_hashes)
    index = fresh("w1")
    prompt = tokens(3, seed=1)
    index.apply("w1", engine.store(prompt, S))
    assert index.num_blocks("w1") == 3

    assert match(index, prompt, S) == {"w1": 3}
    assert match(index, prompt + [7] * 5, S) == {"w1": 3}  # partial tail: no block, no effect
    assert match(index, prompt + tokens(2, seed=99), S) == {"w1": 3}  # longer prompt

    shares_two = prompt[:2 * BS] + tokens(1, seed=2)
    assert match(index, shares_two, S) == {"w1": 2}
    last_token_differs = prompt[:-1] + [prompt[-1] + 1]
    assert match(index, last_token_differs, S) == {"w1": 2}
    first_token_differs = [prompt[0] + 1] + prompt[1:]
    assert match(index, first_token_differs, S) == {}
    assert match(index, prompt[:BS - 1], S) == {}  # not even one full block
    assert match(index, [], S) == {}


def test_look_alike_prompt_of_another_tenant_never_matches():
    engine = FakeEngine(1)
    index = fresh("w1")
    prompt = tokens(3, seed=1)
    index.apply("w1", engine.store(prompt, S))
    assert match(index, prompt, OTHER_TENANT) == {}
    assert match(index, prompt, None) == {}
    assert match(index, prompt, S) == {"w1": 3}


def test_unsalted_blocks_match_only_unsalted_prompts():
    engine = FakeEngine(1)
    index = fresh("w1")
    prompt = tokens(2, seed=1)
    index.apply("w1", engine.store(prompt, None))
    assert match(index, prompt, None) == {"w1": 2}
    assert match(index, prompt, S) == {}


def test_chain_stored_in_several_events():
    engine = FakeEngine(1)
    index = fresh("w1")
    prompt = tokens(5, seed=3)
    index.apply("w1", engine.store(prompt, S, 0, 2))
    assert match(index, prompt, S) == {"w1": 2}
    index.apply("w1", engine.store(prompt, S, 2, 3))
    index.apply("w1", engine.store(prompt, S, 3, 5))
    assert match(index, prompt, S) == {"w1": 5}
    assert index._workers["w1"].orphans == 0


def test_restoring_a_stored_block_is_idempotent():
    engine = FakeEngine(1)
    index = fresh("w1")
    prompt = tokens(3, seed=3)
    index.apply("w1", engine.store(prompt, S))
    index.apply("w1", engine.store(prompt, S))
    assert index.num_blocks("w1") == 3
    assert match(index, prompt, S) == {"w1": 3}


def test_lora_adapter_is_part_of_the_namespace():
    engine = FakeEngine(1)
    index = fresh("w1")
    prompt = tokens(3, seed=4)
    index.apply("w1", engine.store(prompt, S_LORA, lora=LORA))
    assert match(index, prompt, S_LORA) == {"w1": 3}
    assert match(index, prompt, S) == {}  # same tenant, base model: no match
    assert match(index, prompt, Namespace(MODEL, adapter="other-lora", tenant="acme").cache_salt()) == {}


def test_two_workers_with_different_prefix_lengths():
    index = fresh("w1", "w2", "w3")
    e1, e2, e3 = FakeEngine(1), FakeEngine(2, int_hashes=True), FakeEngine(3)
    prompt = tokens(6, seed=5)
    index.apply("w1", e1.store(prompt, S, 0, 4))
    index.apply("w2", e2.store(prompt, S, 0, 2))
    index.apply("w3", e3.store(tokens(6, seed=6), S))  # unrelated prompt
    assert match(index, prompt, S) == {"w1": 4, "w2": 2}
    index.apply("w2", e2.store(prompt, S, 2, 6))
    assert match(index, prompt, S) == {"w1": 4, "w2": 6}
    # The same blocks under another tenant's salt on w3: still nobody for tenant S but w1, w2.
    index.apply("w3", e3.store(prompt, OTHER_TENANT))
    assert match(index, prompt, S) == {"w1": 4, "w2": 6}
    assert match(index, prompt, OTHER_TENANT) == {"w3": 6}


def test_block_removed_in_the_middle_shortens_the_match():
    engine = FakeEngine(1)
    index = fresh("w1", "w2")
    prompt = tokens(5, seed=7)
    index.apply("w1", engine.store(prompt, S))
    index.apply("w2", FakeEngine(2).store(prompt, S))
    index.apply("w1", engine.remove(prompt, S, [2]))
    assert match(index, prompt, S) == {"w1": 2, "w2": 5}  # w2 unaffected
    assert index.num_blocks("w1") == 4
    index.apply("w1", engine.remove(prompt, S, [0]))
    assert match(index, prompt, S) == {"w2": 5}
    index.apply("w1", engine.store(prompt, S, 0, 3))  # re-stored: children reachable again
    assert match(index, prompt, S) == {"w1": 5, "w2": 5}


def test_removing_unknown_blocks_is_harmless():
    engine = FakeEngine(1)
    index = fresh("w1")
    prompt = tokens(2, seed=8)
    index.apply("w1", engine.store(prompt, S))
    index.apply("w1", BlockRemoved(block_hashes=[b"\x00" * 32, 12345]))
    index.apply("w1", engine.remove(prompt, S, [1]))
    index.apply("w1", engine.remove(prompt, S, [1]))
    assert match(index, prompt, S) == {"w1": 1}


def test_all_blocks_cleared_empties_that_worker_only():
    index = fresh("w1", "w2")
    prompt = tokens(3, seed=9)
    index.apply("w1", FakeEngine(1).store(prompt, S))
    index.apply("w2", FakeEngine(2).store(prompt, S))
    index.apply("w1", AllBlocksCleared())
    assert index.num_blocks("w1") == 0
    assert index.incarnation("w1") == "w1-inc1"  # still the same incarnation, still tracked
    assert match(index, prompt, S) == {"w2": 3}
    index.apply("w1", FakeEngine(1).store(prompt, S, 0, 1))
    assert match(index, prompt, S) == {"w1": 1, "w2": 3}


def test_purge_and_new_incarnation_remove_all_entries():
    index = fresh("w1", "w2")
    prompt = tokens(4, seed=10)
    index.apply("w1", FakeEngine(1).store(prompt, S))
    index.apply("w2", FakeEngine(2).store(prompt, S, 0, 2))

    index.reset_worker("w1", "w1-inc2")  # the worker restarted
    assert index.incarnation("w1") == "w1-inc2"
    assert index.num_blocks("w1") == 0
    assert match(index, prompt, S) == {"w2": 2}

    index.purge("w2")  # the worker is gone
    assert index.incarnation("w2") is None
    assert index.num_blocks("w2") == 0
    assert match(index, prompt, S) == {}
    assert index._owners == {}  # nothing left behind
    index.purge("w2")  # twice: harmless
    index.purge("never-seen")


def test_events_for_an_unknown_worker_are_refused():
    index = PrefixIndex()
    with pytest.raises(KeyError):
        index.apply("ghost", FakeEngine(1).store(tokens(1, seed=1), S))


# ---------------------------------------------------------------- orphans


def test_stored_blocks_with_unknown_parent_are_orphans():
    engine = FakeEngine(1)
    index = fresh("w1")
    prompt = tokens(4, seed=11)
    index.apply("w1", engine.store(prompt, S, 2, 4))  # blocks 2, 3 without 0, 1
    assert index._workers["w1"].orphans == 2
    assert index.num_blocks("w1") == 0
    assert match(index, prompt, S) == {}


# ---------------------------------------------------------------- snapshots


def records_of(engine: FakeEngine, toks: list[int], salt: str | None, lora: str | None = None):
    return list(kv_events.stored_blocks(engine.store(toks, salt, lora=lora)))


def test_load_snapshot_with_children_before_parents():
    engine = FakeEngine(1)
    a, b = tokens(6, seed=12), tokens(4, seed=13)
    records = records_of(engine, a, S) + records_of(engine, b, OTHER_TENANT)
    for order in (records[::-1], random.Random(0).sample(records, len(records))):
        index = PrefixIndex()
        index.load_snapshot("w1", "inc-1", order)
        assert index.incarnation("w1") == "inc-1"
        assert index.num_blocks("w1") == 10
        assert index._workers["w1"].orphans == 0
        assert match(index, a, S) == {"w1": 6}
        assert match(index, b, OTHER_TENANT) == {"w1": 4}
        assert match(index, b, S) == {}


def test_load_snapshot_counts_and_skips_orphans():
    engine = FakeEngine(1)
    good = records_of(engine, tokens(3, seed=14), S)
    lost = records_of(engine, tokens(4, seed=15), S)[1:]  # the parent of these 3 is missing
    index = PrefixIndex()
    index.load_snapshot("w1", "inc-1", lost[::-1] + good)
    assert index.num_blocks("w1") == 3
    assert index._workers["w1"].orphans == 3
    assert match(index, tokens(3, seed=14), S) == {"w1": 3}
    assert match(index, tokens(4, seed=15), S) == {}


def test_load_snapshot_replaces_previous_entries():
    engine = FakeEngine(1)
    old, new = tokens(3, seed=16), tokens(3, seed=17)
    index = fresh("w1", "w2")
    index.apply("w1", engine.store(old, S))
    index.apply("w2", FakeEngine(2).store(old, S))
    index.load_snapshot("w1", "w1-inc1", records_of(engine, new, S))
    assert match(index, old, S) == {"w2": 3}
    assert match(index, new, S) == {"w1": 3}
    index.load_snapshot("w1", "w1-inc1", [])
    assert index.num_blocks("w1") == 0
    assert match(index, new, S) == {}


def _history(e: FakeEngine, prompts: dict[str, tuple[list[int], str, str | None]]) -> list[KVEventBatch]:
    """A plausible event history: stores in pieces, evictions, re-stores, a LoRA prompt, shared prefixes."""
    a_toks, a_salt, _ = prompts["a"]
    b_toks, b_salt, _ = prompts["b"]
    c_toks, c_salt, c_lora = prompts["c"]
    d_toks, d_salt, _ = prompts["d"]
    return [
        KVEventBatch(ts=1.0, events=[e.store(a_toks, a_salt, 0, 3)]),
        KVEventBatch(ts=2.0, events=[e.store(a_toks, a_salt, 3, 6), e.store(b_toks, b_salt)]),
        KVEventBatch(ts=3.0, events=[e.store(c_toks, c_salt, lora=c_lora)]),
        KVEventBatch(ts=4.0, events=[e.remove(a_toks, a_salt, [5, 4, 3, 2]), e.remove(b_toks, b_salt, [1])]),
        KVEventBatch(ts=5.0, events=[e.store(a_toks, a_salt, 2, 4)]),  # recomputed, re-stored
        KVEventBatch(ts=6.0, events=[e.remove(c_toks, c_salt, [4], lora=c_lora)]),
        KVEventBatch(ts=7.0, events=[e.store(d_toks, d_salt)]),
    ]


def test_resident_snapshot_reproduces_the_event_built_index():
    shared = tokens(2, seed=20)
    prompts = {
        "a": (tokens(6, seed=21), S, None),
        "b": (shared + tokens(2, seed=22), OTHER_TENANT, None),
        "c": (shared + tokens(3, seed=23), S_LORA, LORA),
        "d": (shared + tokens(1, seed=24), S, None),
    }
    probes = [(toks, salt) for toks, salt, _ in prompts.values()]
    probes += [(toks, other) for toks, _, _ in prompts.values() for other in (S, OTHER_TENANT, S_LORA, None)]
    probes += [(shared, S), (shared, S_LORA), (prompts["a"][0][:3 * BS] + shared, S)]

    for int_hashes in (False, True):
        engine = FakeEngine(5, int_hashes)
        history = _history(engine, prompts)

        direct = fresh("w1")
        resident = ResidentBlocks()
        for seq, batch in enumerate(history):
            for event in batch.events:
                direct.apply("w1", event)
            resident.apply(seq, batch)

        snapshot = resident.snapshot("req-1", "w1-inc1")
        assert snapshot.seq == len(history) - 1
        assert snapshot.block_size == BS
        snapshot = wire.decode(wire.encode(snapshot))  # as it travels
        assert isinstance(snapshot, wire.KVSnapshot)

        loaded = PrefixIndex()
        loaded.load_snapshot("w1", snapshot.incarnation, snapshot_records(snapshot))
        for toks, salt in probes:
            assert match(loaded, toks, salt) == match(direct, toks, salt), (salt, len(toks))
        # Spot-check the expected values themselves.
        assert match(direct, prompts["a"][0], S) == {"w1": 4}
        assert match(direct, prompts["c"][0], S_LORA) == {"w1": 4}
        assert match(direct, prompts["c"][0], S) == {"w1": 2}  # the shared prefix, stored by "d"
        assert match(direct, prompts["c"][0], None) == {}
        assert match(direct, prompts["b"][0], OTHER_TENANT) == {"w1": 1}
        assert match(direct, prompts["d"][0], S) == {"w1": 3}
        assert match(direct, shared, S_LORA) == {"w1": 2}


def test_orphans_whose_parent_returns_later():
    """Children stored while their parent is absent, then the parent re-stored.

    The event-built index skipped the children for good (they are never re-linked),
    while a snapshot of the same state links them: the event path may under-claim,
    never over-claim. A resync (snapshot) restores the full prefix.
    """
    engine = FakeEngine(7)
    prompt = tokens(5, seed=40)
    history = [KVEventBatch(ts=1.0, events=[engine.store(prompt, S)]),
               KVEventBatch(ts=2.0, events=[engine.remove(prompt, S, [2, 3, 4])]),
               KVEventBatch(ts=3.0, events=[engine.store(prompt, S, 3, 5)]),  # parent 2 absent: orphans
               KVEventBatch(ts=4.0, events=[engine.store(prompt, S, 2, 3)])]
    direct, resident = fresh("w1"), ResidentBlocks()
    for seq, batch in enumerate(history):
        for event in batch.events:
            direct.apply("w1", event)
        resident.apply(seq, batch)
    assert direct._workers["w1"].orphans == 2
    # ResidentBlocks now lists block 2 after its children; load_snapshot copes.
    snapshot = resident.snapshot("r", "w1-inc1")
    order = [b.engine_hash for b in snapshot.blocks]
    hashes = engine.hashes(prompt, S)
    assert order.index(hashes[2]) > order.index(hashes[3])
    loaded = PrefixIndex()
    loaded.load_snapshot("w1", "w1-inc1", snapshot_records(snapshot))
    assert match(direct, prompt, S) == {"w1": 3}
    assert match(loaded, prompt, S) == {"w1": 5}  # what the engine really holds


def test_resident_snapshot_after_all_blocks_cleared():
    engine = FakeEngine(6)
    prompt, later = tokens(3, seed=30), tokens(2, seed=31)
    history = [KVEventBatch(ts=1.0, events=[engine.store(prompt, S)]),
               KVEventBatch(ts=2.0, events=[AllBlocksCleared(), engine.store(later, S)])]
    direct, resident = fresh("w1"), ResidentBlocks()
    for seq, batch in enumerate(history):
        for event in batch.events:
            direct.apply("w1", event)
        resident.apply(seq, batch)
    loaded = PrefixIndex()
    loaded.load_snapshot("w1", "w1-inc1", snapshot_records(resident.snapshot("r", "w1-inc1")))
    for index in (direct, loaded):
        assert match(index, prompt, S) == {}
        assert match(index, later, S) == {"w1": 2}


def test_resident_snapshot_is_empty_right_after_a_reset_and_the_late_event_changes_nothing():
    """vLLM publishes a reset's AllBlocksCleared only at its next step; the worker clears at once."""
    engine = FakeEngine(6)
    prompt, later = tokens(3, seed=32), tokens(2, seed=33)
    resident = ResidentBlocks()
    resident.apply(0, KVEventBatch(ts=1.0, events=[engine.store(prompt, S)]))
    resident.clear()
    emptied = resident.snapshot("r", "w1-inc1")
    assert emptied.blocks == [] and emptied.seq == 0  # events after seq 0 still apply on top
    resident.apply(1, KVEventBatch(ts=2.0, events=[AllBlocksCleared(), engine.store(later, S)]))
    loaded = PrefixIndex()
    loaded.load_snapshot("w1", "w1-inc1", snapshot_records(resident.snapshot("r", "w1-inc1")))
    assert match(loaded, prompt, S) == {} and match(loaded, later, S) == {"w1": 2}


def test_evictions_are_counted_per_worker_and_survive_a_resync():
    engine = FakeEngine(1)
    index = fresh("w1", "w2")
    prompt = tokens(4, seed=3)
    index.apply("w1", engine.store(prompt, S))
    index.apply("w1", engine.remove(prompt, S, [3]))
    index.apply("w1", engine.remove(prompt, S, [1, 2]))
    assert index.num_evicted("w1") == 3 and index.num_evicted("w2") == 0
    assert match(index, prompt, S) == {"w1": 1}
    index.reset_worker("w1", "w1-inc2")  # a snapshot reload or a restart: entries go, the count stays
    assert index.num_evicted("w1") == 3 and index.num_blocks("w1") == 0
