"""Where a worker's heartbeats go: fixed registry addresses, and DNS names looked up again.

An entry ``tcp://HOST:PORT`` is one orchestrator. An entry ``dns://NAME:PORT`` stands for
every address NAME resolves to (all its A and AAAA records), looked up every
``resolve_seconds``: a Kubernetes headless Service names every orchestrator replica that
way, and replicas come and go with new addresses. A lookup that fails (the name has no
records yet, the resolver is down) keeps the addresses the last good one gave, and is tried
again at the next beat rather than after the whole interval, so a worker that starts before
its orchestrators finds them within a beat of their first record.
"""

from __future__ import annotations

import asyncio
import ipaddress
import logging
import socket
from collections.abc import Awaitable, Callable
from dataclasses import dataclass

from foundation.addresses import AddressError, check_host, check_peer_address

logger = logging.getLogger("kvroute.worker.orchestrators")

DNS_SCHEME = "dns://"
DEFAULT_RESOLVE_SECONDS = 5.0  # CoreDNS answers for a Service with a 5 s TTL by default
LOOKUP_TIMEOUT_SECONDS = 5.0

# (name, port) → the IP addresses the name has now; raises OSError when it has none.
Lookup = Callable[[str, int], Awaitable[list[str]]]


@dataclass(frozen=True)
class DnsName:
    name: str
    port: int

    def __str__(self) -> str:
        return f"{DNS_SCHEME}{self.name}:{self.port}"


def parse_entry(entry: str) -> str | DnsName:
    """A registry address as given (``tcp://HOST:PORT``), or a ``DnsName``; raises
    AddressError saying what is wrong."""
    if not entry.startswith(DNS_SCHEME):
        check_peer_address(entry, "orchestrator address")
        return entry
    name, colon, port = entry[len(DNS_SCHEME):].rpartition(":")
    if not colon or not port.isdigit() or not 1 <= int(port) <= 65535:
        raise AddressError(f"orchestrator address {entry!r} is not dns://NAME:PORT")
    check_host(name, f"orchestrator address {entry!r}")
    return DnsName(name, int(port))


def registry_address(ip: str, port: int) -> str:
    return f"tcp://[{ip}]:{port}" if ipaddress.ip_address(ip).version == 6 else f"tcp://{ip}:{port}"


async def system_lookup(name: str, port: int) -> list[str]:
    """Every address ``name`` has, through the system resolver (search domains included)."""
    async with asyncio.timeout(LOOKUP_TIMEOUT_SECONDS):
        infos = await asyncio.get_running_loop().getaddrinfo(name, port, type=socket.SOCK_STREAM)
    return [info[4][0] for info in infos]


class OrchestratorTargets:
    """The registry addresses to beat to now; owned by the heartbeat task."""

    def __init__(self, entries: tuple[str, ...], resolve_seconds: float = DEFAULT_RESOLVE_SECONDS,
                 lookup: Lookup = system_lookup):
        if resolve_seconds <= 0:
            raise ValueError("resolve_seconds must be positive")
        self._entries = [parse_entry(entry) for entry in entries]
        self._resolve_seconds = resolve_seconds
        self._lookup = lookup
        self._resolved: dict[DnsName, tuple[str, ...]] = {}
        self._next_lookup: dict[DnsName, float] = {}
        self._failing: set[DnsName] = set()

    async def current(self, now: float) -> tuple[str, ...]:
        """Every address to beat to, in the order given, each once; ``now`` is monotonic."""
        addresses: list[str] = []
        for entry in self._entries:
            if isinstance(entry, DnsName):
                if now >= self._next_lookup.get(entry, 0.0):
                    await self._resolve(entry, now)
                addresses.extend(self._resolved.get(entry, ()))
            else:
                addresses.append(entry)
        return tuple(dict.fromkeys(addresses))

    async def _resolve(self, entry: DnsName, now: float) -> None:
        try:
            ips = await self._lookup(entry.name, entry.port)
        except (OSError, TimeoutError) as error:
            if entry not in self._failing:
                self._failing.add(entry)
                logger.warning("cannot resolve %s (%s); keeping %s and trying again at every beat", entry,
                               error, ", ".join(self._resolved.get(entry, ())) or "no orchestrator")
            return
        self._failing.discard(entry)
        self._next_lookup[entry] = now + self._resolve_seconds
        found = tuple(sorted({registry_address(ip, entry.port) for ip in ips}))
        if found != self._resolved.get(entry):
            logger.info("%s resolves to %s", entry, ", ".join(found) or "nothing")
            self._resolved[entry] = found
