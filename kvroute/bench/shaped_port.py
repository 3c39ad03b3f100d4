"""A slow link out of one local TCP port: loopback traffic sent *from* ``port`` is
rate-limited, all other loopback traffic is not.

::

    lo root qdisc htb 1:  ── u32 match ip sport <port> ──▶ class 1:10  rate R (the slow link)
                          └─ everything else (default) ─▶ class 1:20  rate 1000 Gbit

A producer's transfer endpoint sends a prompt's KV blocks from its listening port, so
shaping that port puts a slow network between the two workers of one machine while
their RPCs, heartbeats and KV events, and every other program's loopback traffic, keep
loopback speed. (``kvroute.bench.transfer_netns`` shapes a whole veth pair instead,
for processes moved into namespaces.)

The qdisc is machine-wide, so ``ShapedPort`` refuses to replace one it did not make, and
removes its own on exit, also after an error or Ctrl-C. Needs root and tc (iproute2)
with the htb qdisc and the u32 classifier.
"""

from __future__ import annotations

import subprocess
from dataclasses import dataclass

from kvroute.bench.transfer_netns import Shaping, ShapingUnavailable, burst_bytes

DEVICE = "lo"
_UNSHAPED_RATE = "1000gbit"
# htb's quantum is rate / r2q; the default r2q of 10 makes loopback-speed quanta huge and noisy.
_R2Q = "1000"


def _tc(*arguments: str, check: bool = True) -> subprocess.CompletedProcess:
    result = subprocess.run(("tc", *arguments), capture_output=True, text=True)
    if check and result.returncode != 0:
        raise ShapingUnavailable(f"tc {' '.join(arguments)} failed: {result.stderr.strip()}")
    return result


def root_qdisc(device: str = DEVICE) -> str:
    """The kind of ``device``'s root qdisc ('noqueue' when nothing was added)."""
    lines = _tc("qdisc", "show", "dev", device).stdout.splitlines()
    root = next((line for line in lines if " root " in f" {line} "), "")
    return root.split()[1] if root else "noqueue"


@dataclass
class ShapedPort(Shaping):
    """Rate-limit loopback traffic from ``port`` to ``rate`` (tc spelling: '100mbit')."""

    port: int
    rate: str

    def _prepare(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"port {self.port} out of range")
        existing = root_qdisc()
        if existing != "noqueue":
            raise ShapingUnavailable(f"{DEVICE} already has a root qdisc ({existing}); not replacing it")

    def _create(self) -> None:
        _tc("qdisc", "add", "dev", DEVICE, "root", "handle", "1:", "htb", "default", "20", "r2q", _R2Q)
        _tc("class", "add", "dev", DEVICE, "parent", "1:", "classid", "1:10", "htb", "rate", self.rate,
            "burst", str(burst_bytes(self.rate)))
        _tc("class", "add", "dev", DEVICE, "parent", "1:", "classid", "1:20", "htb", "rate", _UNSHAPED_RATE)
        _tc("filter", "add", "dev", DEVICE, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
            "match", "ip", "sport", str(self.port), "0xffff", "flowid", "1:10")

    def shaped_bytes(self) -> int:
        """Bytes that went through the slow class so far (proof that the shaping applied)."""
        for block in _tc("-s", "class", "show", "dev", DEVICE).stdout.split("class htb ")[1:]:
            if block.startswith("1:10 "):
                sent = block.split("Sent ", 1)[1]
                return int(sent.split()[0])
        return 0

    @staticmethod
    def remove() -> None:
        """Delete loopback's root qdisc (with its classes and filter); idempotent."""
        if root_qdisc() == "htb":
            _tc("qdisc", "del", "dev", DEVICE, "root", check=False)
