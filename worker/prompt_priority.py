"""Which waiting prompt an engine computes first: vLLM's order, or the shortest expected prefill.

vLLM serves its waiting queue first come, first served, so a 60-token prompt that arrives just
after two 2,000-token ones waits for both. With ``--scheduling shortest-first`` the engine runs
vLLM's priority policy, and this worker gives each request the priority (lower goes first)

    (arrival - start) x prefill rate + prompt tokens to compute

in tokens: when its prefill would end had it started on arrival. A prompt of S tokens goes ahead
of one of L tokens that arrived t seconds earlier only while ``t x rate < L - S``, so a long
prompt is overtaken only by prompts that arrive within about its own prefill time after it,
never starved by a stream of short ones; prompts of one size keep their arrival order.

The rate is the worker's start-up probe's (``worker.prefill_probe``), which a short probe
understates: the window in which short prompts overtake a long one is then a little longer,
which costs the long one at most what those short prompts take. The tokens to compute are the
prompt less its resident prefix and the tokens a pull brings (``worker.queued_prefill``), as
the orchestrator prices them. Only waiting prompts are reordered: a prefill the engine has
started keeps its share of each step, and vLLM's preemption under memory pressure takes the
running request with the latest priority instead of the newest.
"""

from __future__ import annotations

import time
from collections.abc import Callable

from foundation import wire

FCFS = "fcfs"
SHORTEST_FIRST = "shortest-first"
SCHEDULING = (FCFS, SHORTEST_FIRST)
# Prompt tokens a second the priorities assume without a start-up probe (--probe-tokens 0):
# near what one CPU core computes of a small model.
DEFAULT_PREFILL_TOKENS_PER_SECOND = 1000.0


def check_scheduling(name: str) -> str:
    if name not in SCHEDULING:
        raise ValueError(f"scheduling must be one of {', '.join(SCHEDULING)}, not {name!r}")
    return name


def engine_policy(scheduling: str) -> str:
    """vLLM's ``scheduling_policy`` for a worker's ``--scheduling``."""
    return "priority" if scheduling == SHORTEST_FIRST else "fcfs"


class PromptPriorities:
    """Priorities in prompt tokens since this worker started (see the module's docstring)."""

    def __init__(self, probe: wire.PrefillProbe | None, clock: Callable[[], float] = time.monotonic):
        self._clock = clock
        self._start = clock()
        self.tokens_per_second = (probe.new_tokens / probe.seconds if probe is not None and probe.seconds > 0
                                  else DEFAULT_PREFILL_TOKENS_PER_SECOND)

    def of(self, tokens_to_compute: int) -> int:
        """The priority of a prompt arriving now with ``tokens_to_compute`` tokens to prefill."""
        return round((self._clock() - self._start) * self.tokens_per_second) + tokens_to_compute
