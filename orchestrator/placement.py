"""Choosing workers for a request. Pure: no clock, socket or global state inside.

This is the simple placement of the serving path; the cache-aware planner replaces it
by name (``--policy``) without touching the rest of the orchestrator.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass

from orchestrator.registry import WorkerView


class NoWorkerAvailable(RuntimeError):
    """No live worker of a required role."""


@dataclass(frozen=True)
class Candidate:
    view: WorkerView
    in_flight: int  # requests this orchestrator has sent and not yet seen finish

    @property
    def load(self) -> tuple[int, int, str]:
        load = self.view.load
        busy = max(self.in_flight, load.num_running + load.num_waiting)
        return busy, load.num_queued_prefill_tokens, self.view.worker_id


@dataclass(frozen=True)
class Placement:
    prefill: WorkerView
    decode: WorkerView


class LeastLoaded:
    name = "least_loaded"

    def pick(self, candidates: list[Candidate]) -> Candidate:
        return min(candidates, key=lambda c: c.load)


class RoundRobin:
    name = "round_robin"

    def __init__(self):
        self._turn = itertools.count()

    def pick(self, candidates: list[Candidate]) -> Candidate:
        ordered = sorted(candidates, key=lambda c: c.view.worker_id)
        return ordered[next(self._turn) % len(ordered)]


POLICIES = {policy.name: policy for policy in (LeastLoaded, RoundRobin)}


def make_policy(name: str):
    if name not in POLICIES:
        raise ValueError(f"unknown policy {name!r}; choose one of {', '.join(POLICIES)}")
    return POLICIES[name]()


def place(policy, prefill: list[Candidate], decode: list[Candidate]) -> Placement:
    for role, candidates in (("prefill", prefill), ("decode", decode)):
        if not candidates:
            raise NoWorkerAvailable(f"no live {role} worker")
    return Placement(policy.pick(prefill).view, policy.pick(decode).view)
