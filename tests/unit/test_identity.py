"""Cache identity: namespaces → cache salts, and kvroute's chained block hashes."""

from __future__ import annotations

import dataclasses
import random

import pytest

from foundation.identity import SALT_PREFIX, Namespace, block_hashes, chain_seed, next_block_hash

BASE = Namespace(model_fingerprint="smollm2-135m@abc123", adapter="", tenant="acme", scope="default")


def _tokens(n: int, seed: int = 0) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(0, 49_152) for _ in range(n)]


# ---------------------------------------------------------------- cache salt


def test_cache_salt_is_stable_and_prefixed():
    salt = BASE.cache_salt()
    assert salt == BASE.cache_salt()
    assert salt == Namespace("smollm2-135m@abc123", "", "acme", "default").cache_salt()
    assert salt.startswith(SALT_PREFIX)
    # Opaque: none of the fields appear in clear.
    assert "acme" not in salt and "smollm2" not in salt
    # Pinned, so a change in the derivation (which would silently split every cache) is noticed.
    assert salt == "kvr1-6d1418da8567ecd18aedcdcfc81f5183"


def test_a_keyed_salt_differs_between_clusters_and_cannot_be_computed_from_names():
    first, second = BASE.cache_salt(b"\x01" * 32), BASE.cache_salt(b"\x02" * 32)
    assert first != second and BASE.cache_salt() not in (first, second)
    assert first == BASE.cache_salt(b"\x01" * 32) and first.startswith(SALT_PREFIX)
    assert Namespace("smollm2-135m@abc123", "", "globex", "default").cache_salt(b"\x01" * 32) != first


def test_block_hash_derivation_is_pinned():
    # Hashes are compared across orchestrator restarts and versions: pin them.
    assert chain_seed(None) == 0x643806cd7580f0678607fdc9b43add66
    assert block_hashes(list(range(16)), 16, "kvr1-x") == [0x0abdf65da00a80341e69c4236e710e1f]


@pytest.mark.parametrize("field,value", [
    ("model_fingerprint", "smollm2-135m@def456"),
    ("adapter", "sql-lora"),
    ("tenant", "globex"),
    ("scope", "admin"),
])
def test_cache_salt_differs_when_any_field_differs(field, value):
    other = dataclasses.replace(BASE, **{field: value})
    assert other.cache_salt() != BASE.cache_salt()


def test_cache_salt_has_no_field_boundary_ambiguity():
    # Moving characters from one field to the next must not produce the same salt.
    a = Namespace("m", adapter="ab", tenant="c")
    b = Namespace("m", adapter="a", tenant="bc")
    assert a.cache_salt() != b.cache_salt()
    salts = {Namespace("m", adapter=ad, tenant=t, scope=s).cache_salt()
             for ad in ("", "x") for t in ("anonymous", "t1") for s in ("default", "s1")}
    assert len(salts) == 8


def test_default_namespace_fields():
    ns = Namespace("m")
    assert (ns.adapter, ns.tenant, ns.scope) == ("", "anonymous", "default")
    assert ns.cache_salt() == Namespace("m", "", "anonymous", "default").cache_salt()


# ---------------------------------------------------------------- block hashes


def test_block_hashes_cover_full_blocks_only():
    salt = BASE.cache_salt()
    assert block_hashes([], 16, salt) == []
    assert block_hashes(_tokens(15), 16, salt) == []
    assert len(block_hashes(_tokens(16), 16, salt)) == 1
    assert len(block_hashes(_tokens(47), 16, salt)) == 2
    assert len(block_hashes(_tokens(48), 16, salt)) == 3
    # The partial tail does not influence the full blocks' hashes.
    tokens = _tokens(48)
    assert block_hashes(tokens + [1, 2, 3], 16, salt) == block_hashes(tokens, 16, salt)


def test_block_hashes_are_deterministic_128_bit_and_distinct():
    salt = BASE.cache_salt()
    tokens = _tokens(64 * 16)
    hashes = block_hashes(tokens, 16, salt)
    assert hashes == block_hashes(list(tokens), 16, salt)
    assert all(isinstance(h, int) and 0 <= h < 1 << 128 for h in hashes)
    assert len(set(hashes)) == len(hashes)


def test_block_hashes_chain_from_the_salt_seed():
    salt = BASE.cache_salt()
    tokens = _tokens(48)
    hashes = block_hashes(tokens, 16, salt)
    parent = chain_seed(salt)
    for i, h in enumerate(hashes):
        assert h == next_block_hash(parent, tokens[i * 16:(i + 1) * 16])
        parent = h


def test_changing_an_early_token_changes_every_later_hash():
    salt = BASE.cache_salt()
    tokens = _tokens(8 * 16)
    original = block_hashes(tokens, 16, salt)
    changed = list(tokens)
    changed[20] += 1  # inside block 1
    altered = block_hashes(changed, 16, salt)
    assert altered[0] == original[0]
    assert all(a != o for a, o in zip(altered[1:], original[1:]))


def test_changing_a_late_token_leaves_earlier_hashes():
    salt = BASE.cache_salt()
    tokens = _tokens(8 * 16)
    original = block_hashes(tokens, 16, salt)
    changed = list(tokens)
    changed[-1] += 1  # last token of the last block
    altered = block_hashes(changed, 16, salt)
    assert altered[:-1] == original[:-1]
    assert altered[-1] != original[-1]


def test_same_blocks_at_different_positions_hash_differently():
    salt = BASE.cache_salt()
    block = _tokens(16)
    hashes = block_hashes(block * 4, 16, salt)
    assert len(set(hashes)) == 4


def test_token_order_within_a_block_matters():
    salt = BASE.cache_salt()
    tokens = _tokens(16)
    swapped = list(tokens)
    swapped[0], swapped[1] = swapped[1], swapped[0]
    assert tokens[0] != tokens[1]
    assert block_hashes(tokens, 16, salt) != block_hashes(swapped, 16, salt)


# ---------------------------------------------------------------- isolation (negative tests)


def test_look_alike_prompts_under_different_salts_share_no_hash():
    tokens = _tokens(32 * 16, seed=7)
    tenant_a = dataclasses.replace(BASE, tenant="tenant-a").cache_salt()
    tenant_b = dataclasses.replace(BASE, tenant="tenant-b").cache_salt()
    a = block_hashes(tokens, 16, tenant_a)
    b = block_hashes(tokens, 16, tenant_b)
    assert len(a) == len(b) == 32
    assert set(a).isdisjoint(b)
    # Not even a shifted coincidence against the unsalted chain.
    assert set(a).isdisjoint(block_hashes(tokens, 16, None))
    assert set(b).isdisjoint(block_hashes(tokens, 16, None))


def test_adapters_enter_the_namespace():
    tokens = _tokens(16 * 16, seed=11)
    base = dataclasses.replace(BASE, adapter="")
    lora = dataclasses.replace(BASE, adapter="sql-lora")
    other_lora = dataclasses.replace(BASE, adapter="chat-lora")
    salts = {ns.cache_salt() for ns in (base, lora, other_lora)}
    assert len(salts) == 3
    chains = [set(block_hashes(tokens, 16, ns.cache_salt())) for ns in (base, lora, other_lora)]
    for i in range(3):
        for j in range(i + 1, 3):
            assert chains[i].isdisjoint(chains[j])


def test_many_namespaces_never_collide_on_shared_tokens():
    tokens = _tokens(4 * 16, seed=3)
    seen: set[int] = set()
    total = 0
    for tenant in range(20):
        for scope in ("default", "admin"):
            ns = Namespace("m@1", adapter="", tenant=f"t{tenant}", scope=scope)
            hashes = block_hashes(tokens, 16, ns.cache_salt())
            total += len(hashes)
            seen.update(hashes)
    assert len(seen) == total


def test_no_salt_and_empty_salt_are_the_same_root():
    # vLLM treats an empty cache_salt as none; kvroute's seed agrees.
    assert chain_seed(None) == chain_seed("")
    assert chain_seed(None) != chain_seed(BASE.cache_salt())
