"""A process's NIXL agents, one per link role, and the notices their links exchange.

An agent (a UCX context and worker: ~0.25 s to make here) is what registers memory and
moves bytes; a link is cheap. So a process makes one agent per role on its first link and
keeps it: the sending ends of all its links share one, the receiving ends another (an
agent cannot be its own peer, and a process may hold both ends, as the contract tests do).
Agents learn of each other only from metadata handed over kvroute's own channels
(``nixl_backend``): no NIXL listener thread, no metadata server, no port of NIXL's own.

No NIXL progress thread either: it spins, one core per agent (two idle agents took 2 s of
CPU a second on this machine). An agent progresses when a link end polls it, and every wait
of a link polls (``wait_until``); once a UCX connection is up, a notice reaches its peer
without the sender's progress, which is why opening a link waits for a reply both ways.

UCX's tcp transport, which carries the notifications, listens on a port of its own on
every network device it uses; an agent made for links on a loopback address keeps it on
``lo`` (``ucx_environment``), as the other backends bind where ``TransportSettings.host`` says.

Notices are small msgpack messages over NIXL notifications (UCX active messages), each
naming its link. ``Mailboxes`` sorts what an agent received into one queue per link and
drops notices of links it does not hold. A link id is a random token that travelled only
over kvroute's authenticated channel, so a notice naming it comes from that link's peer;
the end checks the sending agent's name as well.
"""

from __future__ import annotations

import functools
import ipaddress
import os
import secrets
import socket
import threading
import time
from collections import Counter, deque
from collections.abc import Callable
from typing import TypeVar

import msgspec
import numpy as np
import torch

from transfer.transports.errors import PeerLost, TransportTimeout

T = TypeVar("T")


class Joined(msgspec.Struct, tag="joined", array_like=True):
    """Receiver to sender: the receiving agent's connection metadata."""

    link: str
    metadata: bytes


class Accepted(msgspec.Struct, tag="accepted", array_like=True):
    """Sender to receiver: the sender loaded that metadata; the link is open."""

    link: str


class Header(msgspec.Struct, tag="header", array_like=True):
    link: str
    packed: bytes  # a TransferHeader


class Frames(msgspec.Struct, tag="frames", array_like=True):
    """One message of frames, ready to READ from the sender's registered memory."""

    link: str
    message: int  # numbers a link's messages from 0, across its transfers
    address: int
    nbytes: int
    device: int  # the CUDA device index for VRAM, 0 for host memory
    digests: bytes | None = None  # the frames' checksums, in a checksummed transfer
    metadata: list[bytes] = []  # partial metadata of buffers registered since the last message


class Released(msgspec.Struct, tag="released", array_like=True):
    """Receiver to sender: message ``message`` was read, its buffer is the sender's again."""

    link: str
    message: int


class Closed(msgspec.Struct, tag="closed", array_like=True):
    link: str
    reason: str


Notice = Joined | Accepted | Header | Frames | Released | Closed
_encoder = msgspec.msgpack.Encoder()
_decoder = msgspec.msgpack.Decoder(Notice)


def encode_notice(notice: Notice) -> bytes:
    return _encoder.encode(notice)


def decode_notice(payload: bytes) -> Notice | None:
    """The notice, or None for anything that is not one (it is dropped)."""
    try:
        return _decoder.decode(payload)
    except (msgspec.DecodeError, msgspec.ValidationError, UnicodeDecodeError, RecursionError):
        return None


class Mailboxes:
    """One queue of (sending agent, notice) per open link; thread-safe."""

    def __init__(self) -> None:
        self._queues: dict[str, deque[tuple[str, Notice]]] = {}
        self._lock = threading.Lock()

    def open(self, link: str) -> None:
        with self._lock:
            self._queues[link] = deque()

    def close(self, link: str) -> None:
        with self._lock:
            self._queues.pop(link, None)

    def sort(self, received: dict[str, list[bytes]]) -> None:
        """File an agent's new notifications (sending agent -> payloads) under their links."""
        with self._lock:
            for sender, payloads in received.items():
                for payload in payloads:
                    notice = decode_notice(payload)
                    queue = self._queues.get(notice.link) if notice is not None else None
                    if queue is not None:
                        queue.append((sender, notice))

    def take(self, link: str) -> tuple[str, Notice] | None:
        with self._lock:
            queue = self._queues.get(link)
            return queue.popleft() if queue else None


# Polling pauses: the first polls only yield the GIL (a notice or a READ of a few MiB is
# often done within tens of microseconds), then the pause doubles up to a millisecond so a
# long wait costs little CPU on a machine with few cores.
FIRST_PAUSE_SECONDS, LONGEST_PAUSE_SECONDS, YIELDING_POLLS = 20e-6, 1e-3, 50


def wait_until(ready: Callable[[], T | None], deadline: float, what: str) -> T:
    """Poll ``ready()`` until it returns something other than None; TransportTimeout at ``deadline``."""
    polls, pause = 0, FIRST_PAUSE_SECONDS
    while (value := ready()) is None:
        if time.monotonic() >= deadline:
            raise TransportTimeout(f"deadline passed waiting for {what}")
        polls += 1
        if polls <= YIELDING_POLLS:
            time.sleep(0)
        else:
            time.sleep(pause)
            pause = min(pause * 2, LONGEST_PAUSE_SECONDS)
    return value


@functools.cache
def nixl_missing() -> str:
    """Why NIXL cannot run in this process ("" when it can); asked once."""
    try:
        import nixl_cu12._api  # noqa: F401
    except Exception as error:  # an ImportError, or a missing shared library of its wheel
        return f"nixl_cu12 cannot be imported ({error}); install it with pip install --no-deps nixl-cu12==1.5.1"
    return ""


def _mem_type(tensor: torch.Tensor) -> str:
    # VRAM: registered and read the same way, but never run here (no GPU on these machines).
    return "VRAM" if tensor.device.type == "cuda" else "DRAM"


def device_index(tensor: torch.Tensor) -> int:
    """The device id NIXL's descriptors take: the CUDA device's, 0 for host memory."""
    return (tensor.device.index or 0) if tensor.device.type == "cuda" else 0


# UCX's tcp transport has no one-sided READ: it serves one in software, the data coming back
# in active messages of at most its segment size (8 KiB to send, 64 KiB to receive by
# default). Between two network namespaces of one machine (``kvroute bench transfer``,
# veth at 20 and 100 Gbit/s, 2.9-94 MB), NIXL READs ran at 0.27-0.62x raw pyzmq tcp with
# those segments and at 0.64-1.73x (median 1.23x unshaped, 0.96x shaped to 20 Gbit/s) with
# 1 MiB segments and 4 MiB socket buffers (docs/transfer.md). The operator's values stand.
UCX_TCP_DEFAULTS = {"UCX_TCP_TX_SEG_SIZE": "1m", "UCX_TCP_RX_SEG_SIZE": "1m",
                    "UCX_TCP_SNDBUF": "4m", "UCX_TCP_RCVBUF": "4m"}


def ucx_environment(host: str, environment: dict[str, str]) -> dict[str, str]:
    """The UCX settings to add before an agent starts, for links bound to ``host``: on a
    loopback address, UCX's network devices are ``lo`` only (unless UCX_NET_DEVICES is set),
    so its tcp listener is not reachable from other hosts; and tcp segments large enough
    for READs (``UCX_TCP_DEFAULTS``). UCX_TLS is left to UCX: on one host it picks cma for
    READs, and narrowing it to tcp made READs 3x slower here."""
    try:
        loopback = ipaddress.ip_address(host).is_loopback
    except ValueError:
        loopback = host == "localhost"
    added = {name: value for name, value in UCX_TCP_DEFAULTS.items() if name not in environment}
    if loopback and "UCX_NET_DEVICES" not in environment:
        added["UCX_NET_DEVICES"] = "lo"
    return added


class Agent:
    """One NIXL agent with the UCX backend, shared by the links of one role in this process.

    NIXL's strict thread mode lets several link threads call it at once; peers are counted,
    so two links to the same peer agent load its metadata once and drop it with the last."""

    def __init__(self, role: str):
        from nixl_cu12 import _bindings
        from nixl_cu12._api import nixl_agent, nixl_agent_config, nixl_thread_sync_t

        self.name = f"kvroute-{role}-{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(4)}"
        config = nixl_agent_config(enable_prog_thread=False, enable_listen_thread=False, backends=["UCX"],
                                   sync_mode=nixl_thread_sync_t.NIXL_THREAD_SYNC_STRICT)
        self._nixl = nixl_agent(self.name, config)
        self._no_memory = _bindings.nixlRegDList(_bindings.DRAM_SEG)
        self.mailboxes = Mailboxes()
        self._peers: Counter[str] = Counter()
        self._peers_lock = threading.Lock()

    def connection_metadata(self) -> bytes:
        """What a peer needs to reach this agent, without any registered memory."""
        return self._nixl.get_partial_agent_metadata(self._no_memory, True)

    def register(self, tensor: torch.Tensor):
        """Register ``tensor``; returns its registration and the partial metadata a peer
        loads (``learn``) to READ it."""
        registration = self._nixl.register_memory(tensor)
        return registration, self._nixl.get_partial_agent_metadata(registration, False)

    def register_for_peers(self, tensors: list[torch.Tensor]):
        """Register ``tensors`` as one registration; returns it and the partial metadata a
        peer that never met this agent loads (``add_peer``) to READ them: connection and memory."""
        registration = self._nixl.register_memory(tensors)
        return registration, self._nixl.get_partial_agent_metadata(registration, True)

    def deregister(self, registration) -> None:
        self._nixl.deregister_memory(registration)

    def add_peer(self, metadata: bytes) -> str:
        """Load a peer agent's metadata; returns its name."""
        with self._peers_lock:
            name = self._nixl.add_remote_agent(metadata)
            name = name.decode() if isinstance(name, bytes) else name
            self._peers[name] += 1
            return name

    def learn(self, metadata: bytes) -> None:
        """Load a known peer's partial metadata (memory it registered since)."""
        self._nixl.add_remote_agent(metadata)

    def drop_peer(self, name: str) -> None:
        with self._peers_lock:
            self._peers[name] -= 1
            if self._peers[name] <= 0:
                del self._peers[name]
                self._nixl.remove_remote_agent(name)

    def notify(self, peer: str, notice: Notice) -> None:
        self._nixl.send_notif(peer, encode_notice(notice))

    def progress(self) -> None:
        """Progress the agent (a first READ from a new peer waits for its target's progress),
        filing any notices for the links that poll."""
        self.mailboxes.sort(self._nixl.get_new_notifs())

    def poll(self, link: str) -> tuple[str, Notice] | None:
        """The link's next notice, if any; progresses the agent."""
        found = self.mailboxes.take(link)
        if found is None:
            self.mailboxes.sort(self._nixl.get_new_notifs())
            found = self.mailboxes.take(link)
        return found

    def read(self, into: torch.Tensor, peer: str, address: int, device: int):
        """Start a READ of ``into.numel()`` bytes at the peer's ``address`` into ``into``."""
        nbytes = into.numel()
        local = self._nixl.get_xfer_descs([(into.data_ptr(), nbytes, device_index(into))], _mem_type(into))
        remote = self._nixl.get_xfer_descs([(address, nbytes, device)], _mem_type(into))
        handle = self._nixl.initialize_xfer("READ", local, remote, peer)
        if self._nixl.transfer(handle) == "ERR":
            handle.release()
            raise PeerLost(f"nixl: a READ of {nbytes} bytes from {peer} failed at once")
        return handle

    def read_lists(self, local: np.ndarray, remote: np.ndarray, peer: str):
        """Start one READ of host memory: row i of ``remote`` (address, bytes, 0) at the peer
        into row i of ``local``."""
        handle = self._nixl.initialize_xfer("READ", self._nixl.get_xfer_descs(local, "DRAM"),
                                            self._nixl.get_xfer_descs(remote, "DRAM"), peer)
        if self._nixl.transfer(handle) == "ERR":
            handle.release()
            raise PeerLost(f"nixl: a READ of {int(local[:, 1].sum())} bytes from {peer} failed at once")
        return handle

    def state(self, handle) -> str:
        """"DONE", "PROC" or "ERR"."""
        return self._nixl.check_xfer_state(handle)


_agents: dict[tuple[int, str], Agent] = {}
_agents_lock = threading.Lock()


def agent_for(role: str, host: str) -> Agent:
    """This process's agent for ``role``, made on first use (a forked child makes its own);
    ``host``: the address the first link's end binds, which decides where UCX listens."""
    key = (os.getpid(), role)
    with _agents_lock:
        if key not in _agents:
            os.environ.update(ucx_environment(host, dict(os.environ)))
            _agents[key] = Agent(role)
        return _agents[key]
