"""Settings of a node store process, typed and validated once (flags map onto them in
``kvroute.cli``)."""

from __future__ import annotations

import ipaddress
from dataclasses import dataclass

from foundation.addresses import check_peer_address
from foundation.config import setting

DEFAULT_BIND = "tcp://127.0.0.1:7390"
GIB = 1 << 30


@dataclass(frozen=True)
class NodeStoreSettings:
    bind: str = setting(DEFAULT_BIND, "where the store listens: loopback tcp or ipc only, as it serves the "
                                      "workers of its own host; workers reach it with --node-store ADDR")
    host_kv_gib: float = setting(0.0, "host memory for KV blocks in GiB, fractions allowed")
    disk_kv_dir: str = setting("", "folder for the disk tier (its own subfolder, emptied at start and stop); "
                                   "empty: no disk tier")
    disk_kv_gib: float = setting(0.0, "bytes of the disk tier in GiB; blocks evicted from host memory go there")
    pin_seconds: float = setting(5.0, "how long a block given to a reader is kept from eviction")

    def __post_init__(self):
        check_loopback_or_ipc(self.bind)
        if self.host_kv_gib <= 0:
            raise ValueError("a node store needs --host-kv-gib above 0")
        if self.disk_kv_gib < 0:
            raise ValueError("--disk-kv-gib must not be negative")
        if bool(self.disk_kv_dir) != (self.disk_kv_gib > 0):
            raise ValueError("a disk tier needs both --disk-kv-dir and --disk-kv-gib above 0")
        if self.pin_seconds <= 0:
            raise ValueError("--pin-seconds must be positive")

    @property
    def host_bytes(self) -> int:
        return int(self.host_kv_gib * GIB)

    @property
    def disk_bytes(self) -> int:
        return int(self.disk_kv_gib * GIB)


def check_loopback_or_ipc(address: str) -> None:
    check_peer_address(address, "node store address")
    scheme, _, rest = address.partition("://")
    if scheme == "ipc":
        return
    host = rest.rpartition(":")[0].strip("[]")
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    if not loopback:
        raise ValueError(f"a node store listens on loopback or ipc only (it serves its own host), not {address!r}")
