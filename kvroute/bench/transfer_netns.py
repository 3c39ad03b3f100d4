"""A rate-limited link between two network namespaces of this machine, made and removed by us.

::

    namespace <name>-s                      namespace <name>-r
    ┌──────────────────────┐  veth pair  ┌──────────────────────┐
    │ <veth>s 10.200.0.1/30 ├─────────────┤ <veth>r 10.200.0.2/30 │
    │   tc tbf rate R       │             │   tc tbf rate R       │
    └──────────────────────┘             └──────────────────────┘

Both addresses exist only inside the two namespaces this module creates, so nothing
on the machine's own interfaces changes, and traffic between them crosses the shaped
veth pair instead of loopback. ZeroMQ ipc and other Unix sockets ignore namespaces
(they live in the file system), so a benchmark must force tcp across the link.

``ShapedLink`` removes everything on exit, also after an error or Ctrl-C; deleting a
namespace deletes the veth end inside it. Needs root and ``ip``/``tc`` (iproute2).
A process joins a side with ``enter_namespace`` before it opens any socket.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import subprocess
from dataclasses import dataclass

_CLONE_NEWNET, _CLONE_NEWNS = 0x40000000, 0x00020000
_MS_REC, _MS_PRIVATE, _MNT_DETACH = 0x4000, 1 << 18, 2
SENDER_ADDRESS, RECEIVER_ADDRESS, PREFIX_LENGTH = "10.200.0.1", "10.200.0.2", 30
# tbf needs a bucket of at least one timer tick of traffic at the rate, and at least one
# offloaded (GSO) packet of the veth's; 1/250 s of the rate, never under 256 KiB, is both.
_MIN_BURST_BYTES = 256 * 1024
_QUEUE_LATENCY = "100ms"


class ShapingUnavailable(RuntimeError):
    """This process cannot create namespaces (not root, or no iproute2)."""


def shaping_available() -> str | None:
    """None when namespaces and tc can be used here; otherwise why not."""
    if os.geteuid() != 0:
        return "network namespaces and tc need root"
    missing = [tool for tool in ("ip", "tc") if shutil.which(tool) is None]
    return f"missing {', '.join(missing)} (iproute2)" if missing else None


def rate_bits_per_second(rate: str) -> int:
    """tc's rate spelling ('100mbit', '1gbit', '500kbit') in bits per second."""
    units = {"kbit": 10**3, "mbit": 10**6, "gbit": 10**9, "bit": 1}
    for unit, scale in units.items():
        if rate.endswith(unit):
            return int(float(rate[: -len(unit)]) * scale)
    raise ValueError(f"rate {rate!r}: expected a number with kbit, mbit or gbit")


def burst_bytes(rate: str) -> int:
    return max(rate_bits_per_second(rate) // 8 // 250, _MIN_BURST_BYTES)


def _run(*command: str) -> None:
    result = subprocess.run(command, capture_output=True, text=True)
    if result.returncode != 0:
        raise RuntimeError(f"{' '.join(command)} failed: {result.stderr.strip()}")


def namespace_exists(name: str) -> bool:
    return os.path.exists(f"/run/netns/{name}")


class Shaping:
    """Kernel state (namespaces, qdiscs) made on entry and removed on exit, also when making
    it failed halfway. Subclasses have a ``rate``, check what else they need in
    ``_prepare`` and implement ``_create`` and an idempotent ``remove``."""

    rate: str

    def __enter__(self):
        reason = shaping_available()
        if reason:
            raise ShapingUnavailable(reason)
        rate_bits_per_second(self.rate)  # refuse a bad rate before anything is created
        self._prepare()
        try:
            self._create()
        except BaseException:
            self.remove()
            raise
        return self

    def __exit__(self, *exc) -> None:
        self.remove()

    def _prepare(self) -> None:
        """Refuse what cannot be made, or clear what a crashed run left; before ``_create``."""

    def _create(self) -> None:
        raise NotImplementedError

    def remove(self) -> None:
        raise NotImplementedError


@dataclass
class ShapedLink(Shaping):
    """Two namespaces joined by a veth pair, each end shaped to ``rate`` (tc spelling).

    ``name`` must be short (interface names take 15 characters); make it unique per run."""

    name: str
    rate: str

    @property
    def sender_namespace(self) -> str:
        return f"{self.name}-s"

    @property
    def receiver_namespace(self) -> str:
        return f"{self.name}-r"

    @property
    def sender_device(self) -> str:
        """The veth end inside the sender's namespace."""
        return f"{self.name}s"

    @property
    def receiver_device(self) -> str:
        return f"{self.name}r"

    def _sides(self) -> tuple[tuple[str, str, str], ...]:
        """(namespace, interface, address) of each side."""
        return ((self.sender_namespace, self.sender_device, SENDER_ADDRESS),
                (self.receiver_namespace, self.receiver_device, RECEIVER_ADDRESS))

    def _prepare(self) -> None:
        if len(self.name) > 14:
            raise ValueError(f"link name {self.name!r} is too long for interface names")
        self.remove()  # a crashed run with the same name may have left its namespaces

    def _create(self) -> None:
        sides = self._sides()
        for namespace, _, _ in sides:
            _run("ip", "netns", "add", namespace)
        (sender_ns, sender_if, _), (receiver_ns, receiver_if, _) = sides
        _run("ip", "link", "add", sender_if, "netns", sender_ns, "type", "veth",
             "peer", "name", receiver_if, "netns", receiver_ns)
        for namespace, interface, address in sides:
            inside = ("ip", "netns", "exec", namespace)
            _run(*inside, "ip", "link", "set", "lo", "up")
            _run(*inside, "ip", "addr", "add", f"{address}/{PREFIX_LENGTH}", "dev", interface)
            _run(*inside, "ip", "link", "set", interface, "up")
            _run(*inside, "tc", "qdisc", "add", "dev", interface, "root", "tbf", "rate", self.rate,
                 "burst", str(burst_bytes(self.rate)), "latency", _QUEUE_LATENCY)

    def remove(self) -> None:
        """Delete both namespaces (and with them the veth pair and qdiscs); idempotent."""
        for namespace, _, _ in self._sides():
            if namespace_exists(namespace):
                subprocess.run(("ip", "netns", "del", namespace), capture_output=True)

    def exists(self) -> bool:
        return any(namespace_exists(namespace) for namespace, _, _ in self._sides())


def enter_namespace(name: str | None) -> None:
    """Move the calling thread into network namespace ``name`` (None: stay). Threads it
    starts afterwards (libzmq's, Gloo's) inherit it, so call this before opening sockets.

    As ``ip netns exec`` does, the process also gets a mount namespace of its own with sysfs
    mounted afresh: /sys/class/net otherwise still lists the first namespace's interfaces,
    and UCX, which finds its network devices there, would find none of this one's."""
    if name is None:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/run/netns/{name}", os.O_RDONLY)
    try:
        _checked(libc.setns(fd, _CLONE_NEWNET), f"setns into network namespace {name}")
    finally:
        os.close(fd)
    _checked(libc.unshare(_CLONE_NEWNS), "unshare the mount namespace")
    # Private from / down, so the sysfs mounted next stays in this process's namespace.
    _checked(libc.mount(None, b"/", None, _MS_REC | _MS_PRIVATE, None), "make mounts private")
    _checked(libc.umount2(b"/sys", _MNT_DETACH), "unmount /sys")
    _checked(libc.mount(name.encode(), b"/sys", b"sysfs", 0, None), "mount sysfs")


def _checked(result: int, what: str) -> None:
    if result != 0:
        error = ctypes.get_errno()
        raise OSError(error, f"{what}: {os.strerror(error)}")
