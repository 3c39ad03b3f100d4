"""Retries with exponential backoff and jitter, for idempotent worker calls only.

Stats, snapshot and cache-reset requests ask the same question again and change nothing
(a second reset finds an empty cache), so a lost reply or a worker busy restarting costs
one more attempt, not an error. ``generate`` is never retried here: it is not idempotent,
and a failed placement is moved by the completion service instead.

Attempt n (from 1) that fails waits ``min(max_delay, base_delay * 2**(n-1))`` scaled by a
random factor in ``[1 - jitter, 1]``, so many callers that failed together do not retry
in lockstep. Time and randomness are passed in, for tests.
"""

from __future__ import annotations

import asyncio
import logging
import random
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TypeVar

logger = logging.getLogger("kvroute.orchestrator.retry")

T = TypeVar("T")


@dataclass(frozen=True)
class RetryPolicy:
    attempts: int = 3  # in all, the first included
    base_delay_seconds: float = 0.1
    max_delay_seconds: float = 2.0
    jitter: float = 0.5  # the fraction of each delay that is random

    def __post_init__(self):
        if self.attempts < 1:
            raise ValueError("retry attempts must be at least 1")
        if not 0 <= self.jitter <= 1:
            raise ValueError("retry jitter must be between 0 and 1")

    def delay(self, failed_attempt: int, uniform: float) -> float:
        """Seconds to wait after attempt ``failed_attempt`` failed; ``uniform`` in [0, 1)."""
        ceiling = min(self.max_delay_seconds, self.base_delay_seconds * 2 ** (failed_attempt - 1))
        return ceiling * (1 - self.jitter * uniform)


async def with_retries(call: Callable[[], Awaitable[T]], policy: RetryPolicy, what: str,
                       should_retry: Callable[[Exception], bool],
                       sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
                       uniform: Callable[[], float] = random.random) -> T:
    """``call()`` until it succeeds, up to ``policy.attempts`` times. An error that
    ``should_retry`` refuses, or the last attempt's error, is raised as it is."""
    for attempt in range(1, policy.attempts + 1):
        try:
            return await call()
        except Exception as error:
            if attempt == policy.attempts or not should_retry(error):
                raise
            delay = policy.delay(attempt, uniform())
            logger.info("%s failed (%s); attempt %d of %d in %.2f s", what, error, attempt + 1, policy.attempts,
                        delay)
            await sleep(delay)
    raise AssertionError("unreachable: the last attempt returns or raises")
