"""A launched worker's processes as /proc shows them: CPUs, threads, who listens where."""

from __future__ import annotations

import os
from pathlib import Path

from kvroute.bench.meters import group_pids


def process_affinities(root_pid: int) -> list[dict]:
    """Each process of a worker: pid, name, allowed CPUs, thread count (from /proc)."""
    rows = []
    for pid in group_pids(root_pid):
        try:
            rows.append({"pid": pid, "name": Path(f"/proc/{pid}/comm").read_text().strip(),
                         "cpus": sorted(os.sched_getaffinity(pid)),
                         "threads": len(list(Path(f"/proc/{pid}/task").iterdir()))})
        except (OSError, ProcessLookupError):
            continue
    return rows


def listening_pid(root_pid: int, address: str) -> int | None:
    """The process of a worker's group that listens on ``address`` (tcp://host:port)."""
    port = int(address.rsplit(":", 1)[1])
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            fields = line.split()
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] == "0A":  # LISTEN
                inodes.add(fields[9])
    for pid in group_pids(root_pid):
        try:
            for fd in Path(f"/proc/{pid}/fd").iterdir():
                link = os.readlink(fd)
                if link.startswith("socket:[") and link[8:-1] in inodes:
                    return pid
        except OSError:
            continue
    return None
