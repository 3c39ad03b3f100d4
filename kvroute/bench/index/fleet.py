"""The fleet of ``kvroute bench index``: its shape, its token content and how the index is
populated (``PrefixIndex.apply`` of vLLM-shaped ``BlockStored`` events, as in service)."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass

import numpy as np

from foundation.identity import Namespace
from foundation.kv_events import BlockStored
from orchestrator.index import PrefixIndex

PROMPT_TOKENS = 8192
SYSTEM_TOKENS = 2048
DEFAULT_BLOCK_SIZE = 128
HOT_DOCS = 16
GROUP_DOCS = 64
PRIVATE_TENANTS = 4
PRIVATE_SHARE = 0.25
VOCAB = 49_152
MODEL = "bench-model@rev1"
PUBLIC = Namespace(MODEL, tenant="public").cache_salt()
PRIVATE = [Namespace(MODEL, tenant=f"tenant-{i}").cache_salt() for i in range(PRIVATE_TENANTS)]


@dataclass(frozen=True)
class Shape:
    """The fleet's shape is in blocks of ``block_size`` tokens (``--block-size``): the prompt
    and the system prompt keep their token lengths, their block counts follow."""

    block_size: int = DEFAULT_BLOCK_SIZE

    def __post_init__(self) -> None:
        if self.block_size < 1 or SYSTEM_TOKENS % self.block_size:
            raise SystemExit(f"--block-size must divide {SYSTEM_TOKENS}, got {self.block_size}")

    @property
    def prompt_blocks(self) -> int:
        return PROMPT_TOKENS // self.block_size

    @property
    def system_blocks(self) -> int:
        return SYSTEM_TOKENS // self.block_size


# ---------------------------------------------------------------- token content


def chunk(seed: int, n_blocks: int, shape: Shape) -> list[int]:
    """Deterministic token ids of ``n_blocks`` blocks, regenerated on demand (never stored)."""
    rng = np.random.default_rng(seed)
    return rng.integers(1, VOCAB, n_blocks * shape.block_size, dtype=np.int64).tolist()


SYSTEM_SEED = 1


def hot_seed(h: int) -> int:
    return 1_000 + h


def group_seed(g: int, k: int) -> int:
    return 10_000 + g * 1_000 + k


def unique_seed(w: int, j: int) -> int:
    return 10_000_000 + w * 100_000 + j


def document(doc: tuple[str, int, int], shape: Shape) -> list[int]:
    """System prompt + document continuation: one whole prompt."""
    kind, a, b = doc
    seed = hot_seed(a) if kind == "hot" else group_seed(a, b)
    return (chunk(SYSTEM_SEED, shape.system_blocks, shape)
            + chunk(seed, shape.prompt_blocks - shape.system_blocks, shape))


# ---------------------------------------------------------------- population


class WorkerWriter:
    """Emits one worker's BlockStored events, with its own engine hashes (ints, as vLLM's may be)."""

    def __init__(self, index: PrefixIndex, worker_id: str, base: int, block_size: int):
        self.index, self.block_size = index, block_size
        self.worker_id = worker_id
        self.next_hash = base
        self.blocks = 0

    def store(self, token_ids: list[int], parent: int | None, salt: str | None) -> list[int]:
        n = len(token_ids) // self.block_size
        hashes = list(range(self.next_hash, self.next_hash + n))
        self.next_hash += n
        extra = [[salt]] + [None] * (n - 1) if parent is None and salt else None
        self.index.apply(self.worker_id, BlockStored(block_hashes=hashes, parent_block_hash=parent,
                                                     token_ids=token_ids, block_size=self.block_size, medium="GPU",
                                                     extra_keys=extra))
        self.blocks += n
        return hashes


def populate(index: PrefixIndex, args: argparse.Namespace, rng: random.Random, shape: Shape) -> dict:
    """Every worker's chains into ``index``; the fleet: who holds what, to ask for it later."""
    block_size, prompt_blocks, system_blocks = shape.block_size, shape.prompt_blocks, shape.system_blocks
    workers = [f"w{i:02d}" for i in range(args.workers)]
    groups = [workers[i:i + args.group_size] for i in range(0, len(workers), args.group_size)]
    per_worker = args.blocks // len(workers)
    system = chunk(SYSTEM_SEED, system_blocks, shape)
    hot_tails = [chunk(hot_seed(h), prompt_blocks - system_blocks, shape) for h in range(HOT_DOCS)]
    conversations: list[tuple[str, tuple[str, int, int], int, int]] = []  # worker, doc, branch depth, seed
    privates: list[tuple[str, int, int]] = []  # worker, tenant, seed
    held_depths: dict[str, dict[tuple[str, int, int], int]] = {}

    for g, members in enumerate(groups):
        group_tails = [chunk(group_seed(g, k), prompt_blocks - system_blocks, shape) for k in range(GROUP_DOCS)]
        for w in members:
            index.reset_worker(w, f"{w}-incarnation")
            writer = WorkerWriter(index, w, (int(w[1:]) + 1) << 40, block_size)
            sys_hashes = writer.store(system, None, PUBLIC)
            docs: dict[tuple[str, int, int], tuple[int, list[int]]] = {}  # doc -> (depth, engine hashes)
            for kind, tails in (("hot", hot_tails), ("group", group_tails)):
                for k, tail in enumerate(tails):
                    depth = rng.randint(system_blocks, prompt_blocks)
                    tail_tokens = tail[:(depth - system_blocks) * block_size]
                    hashes = sys_hashes + (writer.store(tail_tokens, sys_hashes[-1], None)
                                           if depth > system_blocks else [])
                    docs[(kind, k, 0) if kind == "hot" else (kind, g, k)] = (depth, hashes)
            held_depths[w] = {doc: depth for doc, (depth, _) in docs.items()}
            doc_keys = list(docs)
            j = 0
            private_budget = int((per_worker - writer.blocks) * PRIVATE_SHARE)
            while writer.blocks < per_worker:
                j += 1
                seed = unique_seed(int(w[1:]), j)
                room = per_worker - writer.blocks
                if private_budget > 0:
                    tenant = rng.randrange(PRIVATE_TENANTS)
                    n = min(prompt_blocks, room)
                    writer.store(chunk(seed, n, shape), None, PRIVATE[tenant])
                    private_budget -= n
                    if n == prompt_blocks:
                        privates.append((w, tenant, seed))
                    continue
                doc = rng.choice(doc_keys)
                depth, hashes = docs[doc]
                branch = rng.randint(system_blocks, depth)
                n = min(prompt_blocks - branch, room)
                if n <= 0:
                    continue
                writer.store(chunk(seed, n, shape), hashes[branch - 1], None)
                if n == prompt_blocks - branch:
                    conversations.append((w, doc, branch, seed))
    return {"workers": workers, "groups": groups, "conversations": conversations, "privates": privates,
            "held_depths": held_depths, "shape": shape}
