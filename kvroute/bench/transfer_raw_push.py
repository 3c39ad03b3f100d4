"""Plain pyzmq PUSH → PULL, zero-copy: the raw baseline of the ZeroMQ link backends.

A ZeroMQ link (``transfer.transports.zmq_backend``) is a PUSH socket on the sender and a
PULL socket on the receiver, over tcp or ipc; its sender starts when its caller tells it
to. The baseline is the same pair of sockets over the same transport, started the same
way (``transfer_pair`` sends both the same command over the same pipe), sending the same
frames, one message each, ``copy=False`` from buffers touched before timing starts. What
it leaves out is everything the link adds: the transfer header, send buffers filled per
transfer, trackers, deadlines and frame checks.
"""

from __future__ import annotations

import torch
import zmq

from transfer.send_buffers import ZERO_COPY_MIN_BYTES
from transfer.transports.zmq_backend import remove_ipc_socket_file


class RawPush:
    """The sending end; ``address`` is what a ``RawPull`` connects to."""

    def __init__(self, bind_address: str, context: zmq.Context | None = None):
        self._socket = (context or zmq.Context.instance()).socket(zmq.PUSH)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.bind(bind_address)
        self.address = self._socket.getsockopt_string(zmq.LAST_ENDPOINT)

    def send(self, frames: list[torch.Tensor]) -> None:
        for frame in frames:
            self._socket.send(memoryview(frame.numpy()), copy=frame.numel() < ZERO_COPY_MIN_BYTES)

    def close(self) -> None:
        self._socket.close(linger=0)
        remove_ipc_socket_file(self.address)


class RawPull:
    def __init__(self, address: str, context: zmq.Context | None = None):
        self._socket = (context or zmq.Context.instance()).socket(zmq.PULL)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._socket.connect(address)

    def receive(self, frame_bytes: int, num_frames: int, timeout: float) -> int:
        """Bytes of ``num_frames`` messages of ``frame_bytes`` each, read zero-copy."""
        received = 0
        for index in range(num_frames):
            if not self._socket.poll(int(timeout * 1000)):
                raise TimeoutError(f"raw frame {index} of {num_frames} did not arrive in {timeout:.0f} s")
            frame = self._socket.recv(copy=False)
            if len(frame) != frame_bytes:
                raise RuntimeError(f"raw frame {index}: {len(frame)} bytes, expected {frame_bytes}")
            received += len(frame)
        return received

    def close(self) -> None:
        self._socket.close(linger=0)
