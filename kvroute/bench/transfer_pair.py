"""Each transport backend against its raw baseline, between the same two processes.

Two spawned processes, each optionally inside a network namespace (``transfer_netns``)
and bound to its own address::

    caller ──plan──▶ receiver process ──commands──▶ sender process
       ◀──rows───        │  ◀──── control (first contact) ────▶ │
                         │  ◀════ link frames / raw frames ════ │

Per backend and transfer size both the backend's link (``transfer.transports``) and its
raw baseline move the same bytes in the same frames: plain pyzmq PUSH/PULL zero-copy over
the backend's own transport (``transfer_raw_push``; over ipc for nixl, whose links move
bytes within one host here, so it is held against the fastest raw path between two
processes, and over tcp where ``PairPlan.nixl_ucx_tls`` puts its READs on tcp) or plain
torch.distributed send/recv (``transfer_raw_dist``). Nothing is gathered or scattered: it is
the transport alone.
Both start the same way, on the same command over the same pipe, and timing runs on the
receiving side from that command to the last frame; one warm-up each, then the
repetitions interleaved so drift hits both alike; medians are reported. Ratio = raw
seconds / backend seconds. With ``PairPlan.checksum`` the link's transfers are also timed
with per-frame checksums (``transfer.transports.checksums``), interleaved the same way:
``checksum_ratio`` = seconds without / seconds with, so 0.95 is a 5% longer transfer.

The command and control pipes are inherited file descriptors, so they work across
network namespaces; only the payload crosses the (possibly shaped) link.
"""

from __future__ import annotations

import multiprocessing
import os
import statistics
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

import torch

from foundation import cluster_keys, zmq_auth
from foundation.wire import KVLayoutSpec
from kvroute.bench import transfer_netns, transfer_raw, transfer_raw_dist
from kvroute.bench.transfer_raw_push import RawPull, RawPush
from transfer.transports.control import ConnectionChannel
from transfer.transports.links import open_receiver, open_sender
from transfer.transports.settings import TransportSettings

RAW_DIST_BASELINE = "raw torch.distributed"  # gloo's
RAW_ZMQ_TRANSPORT = {"zmq-tcp": "tcp", "zmq-ipc": "ipc", "nixl": "ipc"}  # the backends held against raw pyzmq
SENDER_RANK, RECEIVER_RANK = 1, 0  # of the raw Gloo group, which the receiving process hosts
DEADLINE_SECONDS = 120.0


@dataclass(frozen=True)
class PairEnd:
    """Where one process runs: its own address, and the namespace it enters (None: this one)."""

    host: str = "127.0.0.1"
    namespace: str | None = None
    device: str | None = None  # its network interface there, for UCX (None: UCX picks)


@dataclass(frozen=True)
class PairPlan:
    backends: tuple[str, ...]
    frame_sizes: tuple[int, ...]  # bytes per frame, one transfer size each
    num_frames: int  # frames per transfer, one per layer
    reps: int = 5
    sender: PairEnd = field(default_factory=PairEnd)
    receiver: PairEnd = field(default_factory=PairEnd)
    checksum: bool = False  # also time each backend with per-frame checksums
    # The links speak as a worker's do: under this key folder's CURVE keys, and encrypted
    # unless ``transfer_encryption`` is off (foundation.zmq_auth); "" : in clear.
    cluster_keys: str = ""
    transfer_encryption: bool = True
    # UCX_TLS of both processes, for the nixl links ("": UCX chooses). Between network
    # namespaces of one host UCX still reads through cma (process_vm_readv), past the veth
    # and its shaping; "tcp" sends the READs through the network stack, as between hosts,
    # and holds nixl against raw pyzmq over tcp instead of ipc.
    nixl_ucx_tls: str = ""

    def raw_zmq_transport(self, backend: str) -> str | None:
        """The raw pyzmq transport ``backend`` is held against; None: gloo's raw baseline."""
        if backend == "nixl" and self.nixl_ucx_tls == "tcp":
            return "tcp"
        return RAW_ZMQ_TRANSPORT.get(backend)

    def baseline(self, backend: str) -> str:
        transport = self.raw_zmq_transport(backend)
        return f"raw pyzmq {transport}" if transport else RAW_DIST_BASELINE

    def enter(self, end: PairEnd) -> None:
        """Set one of the pair's processes up, before any link opens: keys, UCX, namespace."""
        self.configure_security()
        if self.nixl_ucx_tls:
            os.environ["UCX_TLS"] = self.nixl_ucx_tls
        if end.device:  # else UCX offers lo too, and the peer in the other namespace tries it
            os.environ["UCX_NET_DEVICES"] = end.device
        transfer_netns.enter_namespace(end.namespace)

    def configure_security(self) -> None:
        """In each of the pair's processes, before its links open."""
        keys = cluster_keys.load(self.cluster_keys) if self.cluster_keys else None
        zmq_auth.configure(keys, "worker", self.transfer_encryption)


def stand_in_layout(num_frames: int) -> KVLayoutSpec:
    """Only the first contact reads it; both ends use the same one."""
    return KVLayoutSpec(dtype="uint8", num_layers=num_frames, block_dim=0, block_shape=[1], block_size=1,
                        bytes_per_block=num_frames)


def _raw_zmq_bind_address(transport: str, host: str) -> str:
    return transfer_raw.ipc_bind_address() if transport == "ipc" else f"tcp://{host}:*"


# ---------------------------------------------------------------- the sending process


class Peer:
    """The sending process's state: one link sender per backend, the raw senders."""

    def __init__(self, control: ConnectionChannel, end: PairEnd):
        self.control = control
        self.end = end
        self.senders = {}
        self.raw_group = None
        self.raw_pushes: dict[str, RawPush] = {}
        self.raw_frames: dict[tuple[int, int], list[torch.Tensor]] = {}
        self.touched: set[int] = set()

    def fill_once(self, index: int, out: torch.Tensor) -> None:
        # Writes each send buffer once, on first use, so its pages are mapped as a gather's
        # would be (an untouched buffer reads the shared zero page, unfairly fast); timed
        # repetitions reuse the buffers and measure the transport alone.
        if out.data_ptr() not in self.touched:
            out.fill_(index % 251)
            self.touched.add(out.data_ptr())

    def handle(self, op: str, *args):
        return getattr(self, "_" + op.replace("-", "_"))(*args)

    def _open(self, backend: str, num_frames: int) -> None:
        settings = TransportSettings(backend=backend, host=self.end.host)
        self.senders[backend] = open_sender(self.control, stand_in_layout(num_frames), "cpu",
                                            time.monotonic() + DEADLINE_SECONDS, settings)

    def _send(self, backend: str, frame_bytes: int, num_frames: int, transfer_id: int,
              checksummed: bool = False) -> None:
        self.senders[backend].send([frame_bytes] * num_frames, self.fill_once,
                                   time.monotonic() + DEADLINE_SECONDS, transfer_id, checksummed=checksummed)

    def _raw_zmq_open(self, backend: str, bind_address: str) -> str:
        self.raw_pushes[backend] = RawPush(bind_address)
        return self.raw_pushes[backend].address

    def _raw_zmq_send(self, backend: str, frame_bytes: int, num_frames: int) -> None:
        self.raw_pushes[backend].send(self._touched_frames(frame_bytes, num_frames))

    def _touched_frames(self, frame_bytes: int, num_frames: int) -> list[torch.Tensor]:
        key = (frame_bytes, num_frames)
        if key not in self.raw_frames:
            self.raw_frames = {key: transfer_raw_dist.touched_frames(*key)}  # one size held at a time
        return self.raw_frames[key]

    def _raw_dist_join(self, address: str) -> None:
        store = transfer_raw_dist.connect_store(address)
        self.raw_group = transfer_raw_dist.pair_group(store, SENDER_RANK, host=self.end.host)

    def _raw_dist_send(self, frame_bytes: int, num_frames: int) -> None:
        transfer_raw_dist.send_frames(self.raw_group, self._touched_frames(frame_bytes, num_frames), RECEIVER_RANK)

    def close(self) -> None:
        for sender in [*self.senders.values(), *self.raw_pushes.values()]:
            sender.close()  # a zmq-ipc sender removes its socket file


def sender_main(commands, control, plan: PairPlan) -> None:
    end = plan.sender
    plan.enter(end)
    peer = Peer(ConnectionChannel(control), end)
    try:
        while (command := commands.recv())[0] != "stop":
            try:
                commands.send(("ok", peer.handle(*command)))
            except Exception as error:  # reported to the measuring side, which stops
                commands.send(("error", repr(error)))
    finally:
        peer.close()


# ---------------------------------------------------------------- the measuring process


class Measurement:
    def __init__(self, commands, control, plan: PairPlan):
        self.commands = commands
        self.control = ConnectionChannel(control)
        self.plan = plan
        self.num_frames = plan.num_frames
        self.receivers = {}
        self.raw_zmq = {}
        self.raw_buffers: dict[int, list[torch.Tensor]] = {}
        self.transfer_id = 0

    def ask(self, *command):
        self.commands.send(command)
        return self.answer()

    def answer(self):
        status, value = self.commands.recv()
        if status != "ok":
            raise RuntimeError(f"the sending peer failed: {value}")
        return value

    def open_links(self) -> None:
        for backend in self.plan.backends:
            self.commands.send(("open", backend, self.num_frames))
            settings = TransportSettings(backend=backend, host=self.plan.receiver.host)
            self.receivers[backend] = open_receiver(self.control, stand_in_layout(self.num_frames), "cpu",
                                                    time.monotonic() + DEADLINE_SECONDS, settings)
            self.answer()
            assert self.receivers[backend].backend == backend

    def open_raw(self) -> None:
        for backend in self.plan.backends:
            if transport := self.plan.raw_zmq_transport(backend):
                address = self.ask("raw-zmq-open", backend, _raw_zmq_bind_address(transport, self.plan.sender.host))
                self.raw_zmq[backend] = RawPull(address)
        if "gloo" in self.plan.backends:
            host = self.plan.receiver.host
            self.raw_store, address = transfer_raw_dist.host_store(host)  # kept for the group's lifetime
            self.commands.send(("raw-dist-join", address))
            self.raw_group = transfer_raw_dist.pair_group(self.raw_store, RECEIVER_RANK, host=host)
            self.answer()

    def _timed(self, command: tuple, receive: Callable[[], object]) -> float:
        """Seconds from sending the peer ``command`` until ``receive()`` has every frame; the
        same start for a link and its raw baseline."""
        start = time.perf_counter()
        self.commands.send(command)
        receive()
        seconds = time.perf_counter() - start
        self.answer()
        return seconds

    def backend_seconds(self, backend: str, frame_bytes: int, checksummed: bool = False) -> float:
        self.transfer_id += 1
        frames = [frame_bytes] * self.num_frames
        return self._timed(("send", backend, frame_bytes, self.num_frames, self.transfer_id, checksummed),
                           lambda: self.receivers[backend].receive(frames, lambda *_: None,
                                                                   time.monotonic() + DEADLINE_SECONDS,
                                                                   self.transfer_id, checksummed=checksummed))

    def raw_seconds(self, backend: str, frame_bytes: int) -> float:
        if self.plan.raw_zmq_transport(backend):
            return self._timed(("raw-zmq-send", backend, frame_bytes, self.num_frames),
                               lambda: self.raw_zmq[backend].receive(frame_bytes, self.num_frames, DEADLINE_SECONDS))
        if frame_bytes not in self.raw_buffers:  # one size held at a time
            self.raw_buffers = {frame_bytes: transfer_raw_dist.touched_frames(frame_bytes, self.num_frames)}
        return self._timed(("raw-dist-send", frame_bytes, self.num_frames),
                           lambda: transfer_raw_dist.receive_frames(self.raw_group, self.raw_buffers[frame_bytes],
                                                                    SENDER_RANK))

    def measure(self, backend: str, frame_bytes: int) -> dict:
        timings = {"backend": lambda: self.backend_seconds(backend, frame_bytes),
                   "raw": lambda: self.raw_seconds(backend, frame_bytes)}
        if self.plan.checksum:
            timings["checksum"] = lambda: self.backend_seconds(backend, frame_bytes, checksummed=True)
        for timed in timings.values():  # warm-up
            timed()
        samples = {name: [] for name in timings}
        order = list(timings)
        for rep in range(self.plan.reps):
            # Each goes first in turn: whatever the first leaves behind (a busy I/O thread,
            # references still being released) slows them all alike.
            for name in order[rep % len(order):] + order[:rep % len(order)]:
                samples[name].append(timings[name]())
        return summarise(backend, self.plan.baseline(backend), frame_bytes, self.num_frames, samples)

    def rows(self) -> Iterator[dict]:
        self.open_links()
        self.open_raw()
        try:
            for backend in self.plan.backends:
                for frame_bytes in self.plan.frame_sizes:
                    yield self.measure(backend, frame_bytes)
        finally:
            for raw in self.raw_zmq.values():
                raw.close()


def summarise(backend: str, baseline: str, frame_bytes: int, num_frames: int,
              samples: dict[str, list[float]]) -> dict:
    """One row: medians of the backend's and the raw baseline's samples, and their ratio."""
    medians = {name: statistics.median(values) for name, values in samples.items()}
    nbytes = frame_bytes * num_frames
    row = {"backend": backend, "baseline": baseline, "bytes": nbytes,
           "frame_bytes": frame_bytes, "num_frames": num_frames, "samples_seconds": samples,
           "backend_seconds": medians["backend"], "raw_seconds": medians["raw"],
           "backend_gb_per_s": nbytes / medians["backend"] / 1e9, "raw_gb_per_s": nbytes / medians["raw"] / 1e9,
           "ratio": medians["raw"] / medians["backend"]}
    if "checksum" in medians:
        row |= {"checksum_seconds": medians["checksum"], "checksum_ratio": medians["backend"] / medians["checksum"]}
    return row


def receiver_main(plan: PairPlan, commands, control, results) -> None:
    try:
        plan.enter(plan.receiver)
        for row in Measurement(commands, control, plan).rows():
            results.send(("row", row))
        results.send(("done", None))
    except Exception as error:
        results.send(("error", repr(error)))
    finally:
        commands.send(("stop",))


# ---------------------------------------------------------------- the caller


def run_pair(plan: PairPlan, on_row: Callable[[dict], None] = lambda row: None,
             timeout: float = 3600.0) -> list[dict]:
    """Measure ``plan`` in two fresh processes; ``on_row`` sees each row as it is measured."""
    spawn = multiprocessing.get_context("spawn")
    commands, peer_commands = spawn.Pipe()
    control, peer_control = spawn.Pipe()
    results, receiver_results = spawn.Pipe()
    sender = spawn.Process(target=sender_main, args=(peer_commands, peer_control, plan),
                           name="kvroute-bench-sender", daemon=True)
    receiver = spawn.Process(target=receiver_main, args=(plan, commands, control, receiver_results),
                             name="kvroute-bench-receiver", daemon=True)
    rows: list[dict] = []
    sender.start()
    receiver.start()
    try:
        while True:
            if not results.poll(timeout):
                raise TimeoutError(f"no measurement for {timeout:.0f} s")
            kind, value = results.recv()
            if kind == "error":
                raise RuntimeError(f"the measuring process failed: {value}")
            if kind == "done":
                return rows
            rows.append(value)
            on_row(value)
    finally:
        for process in (receiver, sender):
            process.join(10)
            if process.is_alive():
                process.kill()
                process.join(5)
