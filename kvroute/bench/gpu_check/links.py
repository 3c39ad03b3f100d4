"""GPU check, part two: the torch.distributed link between two processes, against raw send/recv.

Two spawned processes, the sender (rank 0) and the receiver (rank 1), each on its own
device: two GPUs where there are two, else both on the one GPU. NCCL refuses two ranks
of one communicator on the same GPU ("Duplicate GPU detected"), so on a one-GPU machine
the row reports that refusal (status ``unsupported``) instead of numbers.

::

    parent ──spawn──▶ sender (rank 0)           receiver (rank 1)
                      open_sender ◀── control pipe (first contact) ──▶ open_receiver
                      ◀───────────── "go" over the command pipe ─────── timer starts
                      link frames / raw frames ═══════════════════════▶ timer stops
                                                                        rows ──▶ parent

The link is ``transfer.transports.links`` with the backend chosen by the tensor device
(CUDA -> nccl; on the CPU it is forced to gloo, so the tests exercise this code here).
The raw baseline is a two-rank group of the same backend built straight from
``TCPStore`` and ``PrefixStore``, one blocking send or recv per frame; it shares no code
with the link on purpose. First one transfer whose every byte is checked, then the
repetitions, link and raw interleaved so drift hits both alike; medians are reported.
Ratio = raw seconds / link seconds; the target is 0.8.

The same pair runs once more with the link forced to NIXL (``backend`` NIXL), where
nixl_cu12 is installed: on CUDA frames its READs take the sender's registered VRAM into the
receiver's (UCX's cuda_ipc between processes of one node, or RDMA), the path a decode
worker's pull would take on GPUs; on the CPU, host memory, so the tests run it too. NCCL
cannot be its yardstick on a one-GPU machine, so its raw baseline is the receiver copying
the same frames from one buffer to another on its own device (``copy_``): how near a READ
between two processes comes to the device's own copy.
"""

from __future__ import annotations

import multiprocessing
import statistics
import time
import traceback
from dataclasses import dataclass
from datetime import timedelta

import torch
import torch.distributed as dist
from torch.distributed import PrefixStore, TCPStore

from foundation.wire import KVLayoutSpec
from transfer.transports.control import ConnectionChannel
from transfer.transports.links import open_receiver, open_sender
from transfer.transports.settings import AUTO, TransportSettings

TARGET_RATIO = 0.8
DEFAULT, NIXL = "default", "nixl"  # the link's backend: chosen by the frames' device, or NIXL
BASELINES = {DEFAULT: "torch.distributed send/recv", NIXL: "copy_ on the receiver's device"}
SENDER_RANK, RECEIVER_RANK = 0, 1
DEADLINE_SECONDS = 60.0  # per wait; a hung NCCL init then costs a minute, not the device's budget
RAW_TAG = 7


@dataclass(frozen=True)
class LinkSizes:
    num_frames: int  # frames per transfer, one per layer
    frame_sizes: tuple[int, ...]  # bytes per frame, one transfer size each


GPU_LINK_SIZES = LinkSizes(num_frames=32, frame_sizes=(256 * 1024, 4 * 2**20, 16 * 2**20))
CPU_LINK_SIZES = LinkSizes(num_frames=4, frame_sizes=(4096, 65536))


def pair_devices(device_type: str) -> tuple[str, str]:
    """(sender, receiver) devices: two GPUs when there are two, else the same device twice."""
    if device_type == "cuda" and torch.cuda.device_count() >= 2:
        return "cuda:0", "cuda:1"
    return (f"{device_type}:0",) * 2 if device_type == "cuda" else ("cpu", "cpu")


def link_settings(device: torch.device, backend: str = DEFAULT) -> TransportSettings:
    # CUDA frames choose nccl by themselves (that choice is part of what is checked);
    # CPU frames would choose zmq, so the CPU run forces gloo, the same code path.
    if backend == NIXL:
        return TransportSettings(backend="nixl")
    return TransportSettings(backend=AUTO if device.type == "cuda" else "gloo")


def stand_in_layout(num_frames: int) -> KVLayoutSpec:
    """Only the first contact reads it; both ends use the same one."""
    return KVLayoutSpec(dtype="uint8", num_layers=num_frames, block_dim=0, block_shape=[1], block_size=1,
                        bytes_per_block=num_frames)


def frame_pattern(index: int, nbytes: int, device: torch.device) -> torch.Tensor:
    """Frame ``index``'s bytes in the checked transfer: both ends compute them alike."""
    return ((torch.arange(nbytes, device=device, dtype=torch.int64) * (2 * index + 3) + index) % 251).to(torch.uint8)


def synchronize(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


# ------------------------------------------------------------------ the raw baseline


def raw_group(store: dist.Store, rank: int, device: torch.device):
    prefixed = PrefixStore("kvroute-gpu-check-raw", store)
    if device.type == "cuda":
        options = dist.ProcessGroupNCCL.Options()
        options._timeout = timedelta(seconds=DEADLINE_SECONDS)
        return dist.ProcessGroupNCCL(prefixed, rank, 2, options)
    options = dist.ProcessGroupGloo._Options()
    options._timeout = timedelta(seconds=DEADLINE_SECONDS)
    options._devices = [dist.ProcessGroupGloo.create_device(hostname="127.0.0.1")]
    return dist.ProcessGroupGloo(prefixed, rank, 2, options)


def raw_frames(group, frames: list[torch.Tensor], peer: int, sending: bool) -> None:
    for frame in frames:
        work = group.send([frame], peer, RAW_TAG) if sending else group.recv([frame], peer, RAW_TAG)
        work.wait()
    synchronize(frames[0].device)


# ------------------------------------------------------------------ the sending process


class _Filler:
    """``fill`` for the link: the checked pattern when asked, else each buffer written once
    (so its memory is touched, as a gather's would be) and the transport timed alone."""

    def __init__(self, device: torch.device):
        self.device, self.checked, self._touched = device, False, set()

    def __call__(self, index: int, out: torch.Tensor) -> None:
        if self.checked:
            out.copy_(frame_pattern(index, out.numel(), self.device))
        elif out.data_ptr() not in self._touched:
            out.fill_(index % 251)
            self._touched.add(out.data_ptr())


def sender_main(device_name: str, sizes: LinkSizes, reps: int, control, commands, backend: str = DEFAULT) -> None:
    device = _enter(device_name)
    control = ConnectionChannel(control)
    try:
        sender = open_sender(control, stand_in_layout(sizes.num_frames), device, _deadline(),
                             link_settings(device, backend))
        group = None  # NIXL's baseline is the receiver's own copy: no raw group
        if backend == DEFAULT:
            store = TCPStore("127.0.0.1", 0, 2, True, timedelta(seconds=DEADLINE_SECONDS), wait_for_workers=False)
            commands.send(("raw-address", store.port))
            group = raw_group(store, SENDER_RANK, device)
        fill = _Filler(device)
        while (command := commands.recv())[0] != "stop":  # EOFError if the receiver died
            kind, frame_bytes, transfer_id, fill.checked = command
            if kind == "link":
                sender.send([frame_bytes] * sizes.num_frames, fill, _deadline(), transfer_id)
            else:
                raw_frames(group, _touched(frame_bytes, sizes.num_frames, device), RECEIVER_RANK, sending=True)
        sender.close()
    except Exception:  # the receiver reports; the traceback goes to the log
        traceback.print_exc()


_TOUCHED: dict[tuple, list[torch.Tensor]] = {}


def _touched(frame_bytes: int, num_frames: int, device: torch.device) -> list[torch.Tensor]:
    """Raw frames of one size, allocated and written once (one size held at a time)."""
    key = (frame_bytes, num_frames)
    if key not in _TOUCHED:
        _TOUCHED.clear()
        _TOUCHED[key] = [torch.full((frame_bytes,), index % 251, dtype=torch.uint8, device=device)
                         for index in range(num_frames)]
    return _TOUCHED[key]


def _enter(device_name: str) -> torch.device:
    device = torch.device(device_name)
    if device.type == "cuda":
        torch.cuda.set_device(device)
    return device


def _deadline() -> float:
    return time.monotonic() + DEADLINE_SECONDS


# ------------------------------------------------------------------ the receiving process


class _Measurer:
    """The receiving process's side of every transfer; it asks, then times until the last frame."""

    def __init__(self, device: torch.device, sizes: LinkSizes, receiver, group, commands):
        self.device, self.sizes, self.receiver, self.group, self.commands = device, sizes, receiver, group, commands
        self.transfer_id = 0

    def link_seconds(self, frame_bytes: int, store=lambda index, data: None, checked: bool = False) -> float:
        self.transfer_id += 1
        started = time.perf_counter()
        self.commands.send(("link", frame_bytes, self.transfer_id, checked))
        self.receiver.receive([frame_bytes] * self.sizes.num_frames, store, _deadline(), self.transfer_id)
        synchronize(self.device)
        return time.perf_counter() - started

    def raw_seconds(self, frame_bytes: int) -> float:
        buffers = _touched(frame_bytes, self.sizes.num_frames, self.device)
        if self.group is None:
            return self._copy_seconds(buffers)
        started = time.perf_counter()
        self.commands.send(("raw", frame_bytes, 0, False))
        raw_frames(self.group, buffers, SENDER_RANK, sending=False)
        return time.perf_counter() - started

    def _copy_seconds(self, buffers: list[torch.Tensor]) -> float:
        """The frames copied on this device, buffer to buffer: NIXL's yardstick."""
        targets = [torch.empty_like(buffer) for buffer in buffers]
        synchronize(self.device)
        started = time.perf_counter()
        for target, buffer in zip(targets, buffers):
            target.copy_(buffer)
        synchronize(self.device)
        return time.perf_counter() - started

    def link_exact(self, frame_bytes: int) -> bool:
        """One transfer of known bytes through the link, every frame compared."""
        exact = []
        self.link_seconds(frame_bytes, lambda index, data: exact.append(
            torch.equal(data, frame_pattern(index, data.numel(), self.device))), checked=True)
        return len(exact) == self.sizes.num_frames and all(exact)

    def row(self, frame_bytes: int, reps: int) -> dict:
        exact = self.link_exact(frame_bytes)
        self.raw_seconds(frame_bytes)  # warm-up of the raw path (the checked transfer warmed the link)
        samples = {"link": [], "raw": []}
        for _ in range(reps):
            samples["link"].append(self.link_seconds(frame_bytes))
            samples["raw"].append(self.raw_seconds(frame_bytes))
        baseline = BASELINES[DEFAULT if self.group is not None else NIXL]
        return summarise(self.receiver.backend, frame_bytes, self.sizes.num_frames, samples, exact, baseline)


def summarise(backend: str, frame_bytes: int, num_frames: int, samples: dict[str, list[float]],
              bit_exact: bool, baseline: str = BASELINES[DEFAULT]) -> dict:
    medians = {name: statistics.median(values) for name, values in samples.items()}
    nbytes = frame_bytes * num_frames
    ratio = medians["raw"] / medians["link"]
    return {"backend": backend, "frame_bytes": frame_bytes, "num_frames": num_frames, "bytes": nbytes,
            "bit_exact": bit_exact, "link_seconds": medians["link"], "raw_seconds": medians["raw"],
            "link_gb_per_second": nbytes / medians["link"] / 1e9, "raw_gb_per_second": nbytes / medians["raw"] / 1e9,
            "ratio": ratio, "target_ratio": TARGET_RATIO, "meets_target": bit_exact and ratio >= TARGET_RATIO,
            "reps": len(samples["link"]), "baseline": baseline}


def receiver_main(device_name: str, sizes: LinkSizes, reps: int, control, commands, results,
                  backend: str = DEFAULT) -> None:
    device = _enter(device_name)
    try:
        receiver = open_receiver(ConnectionChannel(control), stand_in_layout(sizes.num_frames), device,
                                 _deadline(), link_settings(device, backend))
        group = None
        if backend == DEFAULT:
            _, port = commands.recv()
            store = TCPStore("127.0.0.1", port, 2, False, timedelta(seconds=DEADLINE_SECONDS))
            group = raw_group(store, RECEIVER_RANK, device)
        measurer = _Measurer(device, sizes, receiver, group, commands)
        results.send(("ok", [measurer.row(frame_bytes, reps) for frame_bytes in sizes.frame_sizes]))
        receiver.close()
    except Exception as error:
        results.send(("error", f"{type(error).__name__}: {error}"))
    finally:
        try:
            commands.send(("stop", 0, 0, False))
        except OSError:  # the sender is gone already
            pass


# ------------------------------------------------------------------ the parent


def check_link(device_type: str, sizes: LinkSizes, reps: int, timeout: float = 2 * DEADLINE_SECONDS,
               backend: str = DEFAULT) -> dict:
    """Run the pair. ``status``: ok (ran, bit-exact), failed (an error or a wrong byte) or
    unsupported (NCCL refused two ranks on one GPU); ``meets_target``: every ratio >= 0.8."""
    devices = pair_devices(device_type)
    context = multiprocessing.get_context("spawn")  # CUDA cannot be used in a forked child
    control = context.Pipe()
    commands = context.Pipe()
    results_out, results_in = context.Pipe(duplex=False)
    processes = [context.Process(target=sender_main,
                                 args=(devices[0], sizes, reps, control[0], commands[0], backend)),
                 context.Process(target=receiver_main,
                                 args=(devices[1], sizes, reps, control[1], commands[1], results_in, backend))]
    for process in processes:
        process.start()
    for end in (*control, *commands, results_in):
        end.close()  # the children hold theirs: a child that dies then reads as EOF, not silence
    try:
        outcome = _outcome(results_out, timeout)
    finally:
        _end(processes)
    return {**link_result(devices, *outcome), "backend": backend}


def check_nixl_link(device_type: str, sizes: LinkSizes, reps: int) -> dict:
    """The pair over a NIXL link, or why it was skipped (nixl_cu12 not installed)."""
    from transfer.transports.nixl_agent import nixl_missing

    missing = nixl_missing()
    if missing:
        return {"check": "link", "backend": NIXL, "devices": list(pair_devices(device_type)), "status": "skipped",
                "meets_target": False, "reason": missing, "rows": []}
    return check_link(device_type, sizes, reps, backend=NIXL)


def _outcome(results, timeout: float) -> tuple[str, object]:
    if not results.poll(timeout):
        return "error", f"no result in {timeout:.0f} s"
    try:
        return results.recv()
    except EOFError:
        return "error", "the receiving process exited without a result (see its traceback above)"


def link_result(devices: tuple[str, str], kind: str, payload) -> dict:
    result = {"check": "link", "devices": list(devices), "same_device": devices[0] == devices[1]}
    if kind == "ok":  # it ran; ok means every byte arrived intact, the ratios say how fast
        return {**result, "status": "ok" if all(row["bit_exact"] for row in payload) else "failed",
                "meets_target": all(row["meets_target"] for row in payload), "rows": payload}
    # NCCL's answer to two ranks on one GPU is a refusal, not a fault of the link.
    unsupported = result["same_device"] and devices[0].startswith("cuda") and "Duplicate GPU" in payload
    return {**result, "status": "unsupported" if unsupported else "failed", "meets_target": False,
            "error": payload, "rows": []}


def _end(processes: list) -> None:
    for process in processes:
        process.join(10)
    for process in processes:
        if process.is_alive():
            process.kill()
            process.join(5)
