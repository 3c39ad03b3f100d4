"""CPU meters for measurements on a shared machine, read from ``/proc``.

* ``ForeignLoad``: the CPU cores other people's processes used over an interval (the
  machine's busy time minus this process tree's), recorded beside a measurement so that a
  disturbed number says so;
* ``wait_for_quiet``: wait, within a budget, for a moment when they leave the CPUs alone;
* ``CpuMeter``: the CPU time of one process, or of the process group it leads.

Linux only.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable
from pathlib import Path

CLOCK_TICKS = os.sysconf("SC_CLK_TCK")


def group_pids(root_pid: int) -> list[int]:
    """Processes in the process group ``root_pid`` leads (e.g. a launched worker's)."""
    try:
        group = os.getpgid(root_pid)
    except ProcessLookupError:
        return []
    pids = []
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                if os.getpgid(int(entry.name)) == group:
                    pids.append(int(entry.name))
            except (ProcessLookupError, PermissionError):
                continue
    return sorted(pids)


def _stat_fields(pid: int) -> list[str]:
    """``/proc/PID/stat`` after the command name (which may hold spaces): field 3 onwards."""
    return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()


def _proc_stats() -> dict[int, tuple[int, int]]:
    """pid → (parent pid, CPU ticks of the process and of its reaped children)."""
    stats = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit():
            try:
                fields = _stat_fields(int(entry.name))
                stats[int(entry.name)] = (int(fields[1]), sum(int(f) for f in fields[11:15]))  # u/s time, cu/cs time
            except (OSError, IndexError, ValueError):
                continue
    return stats


def _system_busy_ticks() -> int:
    """Non-idle CPU ticks of the whole machine since boot (/proc/stat); guest time is already
    part of user and nice time there, so it is not added again."""
    fields = [int(f) for f in Path("/proc/stat").read_text().split("\n", 1)[0].split()[1:]]
    user, nice, system, idle, iowait, irq, softirq, steal = (fields + [0] * 8)[:8]
    return user + nice + system + irq + softirq + steal


def _own_ticks() -> int:
    """CPU ticks of this process and all its descendants (the cluster, its workers, their
    engines), those of reaped children included, so the sum does not drop when one exits."""
    stats = _proc_stats()
    me, verdict = os.getpid(), {}

    def is_mine(pid: int) -> bool:
        path = []
        while pid > 1 and pid not in verdict and pid != me:
            path.append(pid)
            pid = stats.get(pid, (0, 0))[0]
        result = pid == me or verdict.get(pid, False)
        for p in path:
            verdict[p] = result
        return result

    return sum(ticks for pid, (_, ticks) in stats.items() if is_mine(pid))


class ForeignLoad:
    """CPU used since creation by everything outside this process's own tree (other
    people's jobs on a shared machine, short-lived ones included), in cores."""

    def __init__(self):
        self.started = time.perf_counter()
        self.busy, self.own = _system_busy_ticks(), _own_ticks()

    def cores(self) -> float:
        used = max((_system_busy_ticks() - self.busy) - (_own_ticks() - self.own), 0)
        return used / CLOCK_TICKS / max(time.perf_counter() - self.started, 1e-9)


def wait_for_quiet(budget: float, *, threshold: float, window: float, say: Callable[[str], None]) -> float:
    """Wait (about ``budget`` s at most) until other processes use < ``threshold`` cores over
    a ``window`` of seconds; ``say`` reports each wait. Returns the seconds waited."""
    started = time.monotonic()
    while True:
        meter = ForeignLoad()
        time.sleep(window)
        load = meter.cores()
        if load < threshold:
            break
        if time.monotonic() - started >= budget:
            say(f"[yellow]  other processes still use {load:.2f} cores; --wait-quiet budget spent, "
                "measuring under load[/]")
            break
        say(f"  other processes use {load:.2f} cores; waiting for a quieter machine")
    return time.monotonic() - started


class CpuMeter:
    """CPU seconds (user + system, all threads) of one process, or with ``group`` of every
    process in the group it leads (a worker and its engine), from ``/proc``."""

    def __init__(self, pid: int, group: bool = False):
        self.pid, self.group = pid, group
        self.started_wall, self.started_cpu = time.perf_counter(), self.read()

    def read(self) -> float:
        """CPU seconds so far. One process: it must exist. A group: its processes now."""
        if not self.group:
            return self._ticks(self.pid) / CLOCK_TICKS
        total = 0
        for pid in group_pids(self.pid):
            try:
                total += self._ticks(pid)
            except (OSError, IndexError, ValueError):
                continue
        return total / CLOCK_TICKS

    @staticmethod
    def _ticks(pid: int) -> int:
        fields = _stat_fields(pid)
        return int(fields[11]) + int(fields[12])  # utime, stime

    def cores(self) -> float:
        """Cores used on average since the meter was made."""
        return (self.read() - self.started_cpu) / max(time.perf_counter() - self.started_wall, 1e-9)

    def idle_rate(self, seconds: float) -> float:
        """CPU seconds per second over the next ``seconds`` (e.g. while nothing is asked of it)."""
        before = self.read()
        time.sleep(seconds)
        return (self.read() - before) / seconds
