"""What a worker's drain reads of its RPC server, heartbeats and leases, faked (see worker.drain)."""

from __future__ import annotations

import asyncio


class FakeServer:
    """What the drain reads of the RPC server: requests running, and when none is."""

    def __init__(self, running: int):
        self.draining = False
        self.num_active_requests = running
        self._idle = asyncio.Event()
        if running == 0:
            self._idle.set()

    def start_draining(self) -> None:
        self.draining = True

    async def wait_idle(self) -> None:
        await self._idle.wait()

    def finish_all(self) -> None:
        self.num_active_requests = 0
        self._idle.set()


class FakeHeartbeats:
    def __init__(self):
        self.beats_now = 0

    def send_now(self) -> None:
        self.beats_now += 1


class FakeLeases:
    """Held until asked ``settles_after`` times (None: never); counts releases."""

    def __init__(self, settles_after: int | None, held: int = 2):
        self.settles_after, self.held = settles_after, held
        self.checks = self.releases = 0

    async def settled(self) -> bool:
        self.checks += 1
        return self.settles_after is not None and self.checks >= self.settles_after

    async def release(self) -> int:
        self.releases += 1
        return self.held
