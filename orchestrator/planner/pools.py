"""A pool of worker views that are built only when read.

Building a view (reconciling a heartbeat with the load ledger, the index's counts, a
frozen ``WorkerView``) costs microseconds a worker: at 1,000 workers, more than the
cache-aware planner's whole decision over its pruned candidates. Pruning reads only two
things of every worker, its load key and how much of the prompt it holds, and full
views of the few it ranks. A ``LazyPool`` carries those two for every worker and builds
a view the first time it is read, so a policy that prunes pays for the candidates, and
one that reads every worker (the baselines) builds every view, as it would anyway.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence

from orchestrator.planner.views import WorkerView

LoadKey = tuple[int, int, str]  # ``candidates.load_key``: active requests, queued prompt tokens, id


class LazyPool(Sequence[WorkerView]):
    """``len(load_keys)`` workers; ``build(i)`` makes the i-th view, whose ``load_key`` is
    ``load_keys[i]`` and whose ``reachable_blocks`` is ``cached_blocks[i]``; ``built``: views
    already made, by position."""

    def __init__(self, load_keys: list[LoadKey], cached_blocks: list[int], build: Callable[[int], WorkerView],
                 built: dict[int, WorkerView] | None = None):
        if len(load_keys) != len(cached_blocks):
            raise ValueError("a load key and a cached-block count for every worker")
        self.load_keys, self.cached_blocks = load_keys, cached_blocks
        self._build = build
        self._slots: list[WorkerView | None] = [None] * len(load_keys)
        for position, view in (built or {}).items():
            self._slots[position] = view
        self._complete = False  # every slot built: iteration reads the list as it is

    def __len__(self) -> int:
        return len(self._slots)

    def __getitem__(self, index):
        if isinstance(index, slice):
            return [self[i] for i in range(*index.indices(len(self)))]
        view = self._slots[index]  # raises IndexError as a list does
        if view is None:
            position = index if index >= 0 else index + len(self)
            view = self._slots[position] = self._build(position)
        return view

    def __iter__(self) -> Iterator[WorkerView]:
        # A policy that reads every worker (the baselines) may iterate the pool several
        # times a decision: build what is missing once, then iterate the plain list.
        if not self._complete:
            slots, build = self._slots, self._build
            for position, view in enumerate(slots):
                if view is None:
                    slots[position] = build(position)
            self._complete = True
        return iter(self._slots)

    @property
    def num_built(self) -> int:
        """Views built so far (what reading the pool has cost)."""
        return len(self._slots) - self._slots.count(None)
