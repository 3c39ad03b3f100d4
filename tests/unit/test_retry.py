"""Retries of idempotent worker calls: bounded attempts, exponential backoff with jitter,
no retry for errors that would only repeat. A fake worker client fails on cue; sleeping
and randomness are fakes, so the delays are exact. The real worker client's retry over
sockets is in tests/contract/test_worker_client.py."""

from __future__ import annotations

import pytest

from orchestrator.retry import RetryPolicy, with_retries
from orchestrator.worker_client import WorkerError, WorkerTimeout, retryable


class FakeClient:
    """``stats()`` fails with each error of ``failures`` in turn, then answers."""

    def __init__(self, *failures: WorkerError):
        self.failures = list(failures)
        self.calls = 0

    async def stats(self) -> str:
        self.calls += 1
        if self.failures:
            raise self.failures.pop(0)
        return "stats"


class FakeSleep:
    def __init__(self):
        self.delays: list[float] = []

    async def __call__(self, seconds: float) -> None:
        self.delays.append(seconds)


async def call(client: FakeClient, policy: RetryPolicy, sleep: FakeSleep, uniform: float = 0.0):
    return await with_retries(client.stats, policy, "stats", retryable, sleep=sleep, uniform=lambda: uniform)


POLICY = RetryPolicy(attempts=4, base_delay_seconds=0.1, max_delay_seconds=0.3, jitter=0.5)


async def test_transient_failures_are_retried_with_exponential_backoff():
    client, sleep = FakeClient(WorkerTimeout("slow"), WorkerError("unavailable", "busy"),
                               WorkerError("worker_disconnected", "lost")), FakeSleep()
    assert await call(client, POLICY, sleep) == "stats"
    assert client.calls == 4
    assert sleep.delays == pytest.approx([0.1, 0.2, 0.3])  # doubling, capped at max_delay


async def test_jitter_shortens_each_delay_by_up_to_its_fraction():
    client, sleep = FakeClient(WorkerTimeout("slow"), WorkerTimeout("slow")), FakeSleep()
    await call(client, POLICY, sleep, uniform=0.999999)
    assert sleep.delays == pytest.approx([0.05, 0.1], rel=1e-4)


async def test_attempts_are_bounded_and_the_last_error_is_raised():
    client, sleep = FakeClient(*[WorkerTimeout(f"slow {n}") for n in range(5)]), FakeSleep()
    with pytest.raises(WorkerTimeout, match="slow 3"):
        await call(client, POLICY, sleep)
    assert client.calls == 4 and len(sleep.delays) == 3


@pytest.mark.parametrize("code", ["invalid_request", "bad_request", "worker_down", "duplicate"])
async def test_errors_that_would_only_repeat_are_not_retried(code):
    client, sleep = FakeClient(WorkerError(code, "no")), FakeSleep()
    with pytest.raises(WorkerError):
        await call(client, POLICY, sleep)
    assert client.calls == 1 and sleep.delays == []


async def test_one_attempt_means_no_retry():
    client, sleep = FakeClient(WorkerTimeout("slow")), FakeSleep()
    with pytest.raises(WorkerTimeout):
        await call(client, RetryPolicy(attempts=1), sleep)
    assert client.calls == 1


def test_the_policy_is_validated():
    with pytest.raises(ValueError):
        RetryPolicy(attempts=0)
    with pytest.raises(ValueError):
        RetryPolicy(jitter=1.5)
