"""Which CPUs the transfer plane runs on, apart from the engine's compute cores.

vLLM binds its model-worker process to the engine's cores (``--omp-threads-bind``), and
threads inherit that binding. Left there, a pull's receive and its scatter into the KV
cache share one core with each other and with the engine: the two memory passes run
one after the other, and the engine's steps wait behind them. So the connector's
threads (block server, pulls, staging) and its ZeroMQ I/O thread get their own CPU
set, by default every CPU of the machine: libzmq receives the next layer on one core
while the previous one is scattered on another.
"""

from __future__ import annotations

import os

import zmq


def parse_cpus(text: str) -> list[int]:
    """'0-3,6' -> [0, 1, 2, 3, 6]; raises ValueError on anything else."""
    cpus: list[int] = []
    for part in text.split(","):
        part = part.strip()
        if not part:
            continue
        low, _, high = part.partition("-")
        first, last = int(low), int(high or low)
        if first < 0 or last < first:
            raise ValueError(f"bad CPU range {part!r}")
        cpus.extend(range(first, last + 1))
    return cpus


def transfer_cpus(text: str) -> list[int]:
    """The configured CPUs, or every CPU of the machine when ``text`` is empty."""
    return parse_cpus(text) if text.strip() else list(range(os.cpu_count() or 1))


def pin_current_thread(cpus: list[int]) -> None:
    """Bind the calling thread (only) to ``cpus``; CPUs outside this process's cpuset are ignored."""
    try:
        os.sched_setaffinity(0, cpus)
    except OSError:  # e.g. none of them is in the cgroup's cpuset: keep the inherited binding
        pass


def transfer_context(cpus: list[int]) -> zmq.Context:
    """A ZeroMQ context whose I/O thread runs on ``cpus`` (set before its first socket)."""
    context = zmq.Context()
    for cpu in cpus:
        context.set(zmq.THREAD_AFFINITY_CPU_ADD, cpu)
    return context
