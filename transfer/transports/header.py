"""The header that opens every transfer on every backend.

It carries what the receiver must agree with before it accepts any payload: the
caller's transfer id, the size of every frame, and whether every frame comes with its
checksum (``transfer.transports.checksums``). A receiver that expected something
else refuses the transfer instead of writing foreign bytes into its KV cache. Sizes
are checked before any receive is posted because Gloo aborts the whole process when a
message is longer than the buffer it lands in.

Wire form: six little-endian int64 words, so that torch.distributed can carry it as a
tensor and ZeroMQ as one small frame.
"""

from __future__ import annotations

import struct
from dataclasses import dataclass

import xxhash

from transfer.transports.errors import FrameMismatch

MAGIC = int.from_bytes(b"kvroute2", "little")  # also a version: a new layout gets a new magic
_FORMAT = struct.Struct("<6q")
HEADER_BYTES = _FORMAT.size
HEADER_WORDS = HEADER_BYTES // 8
_INT63 = (1 << 63) - 1


def _sizes_digest(frame_bytes: tuple[int, ...]) -> int:
    packed = struct.pack(f"<{len(frame_bytes)}q", *frame_bytes)
    return xxhash.xxh64_intdigest(packed) & _INT63


@dataclass(frozen=True)
class TransferHeader:
    transfer_id: int
    frame_bytes: tuple[int, ...]
    checksummed: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.transfer_id <= _INT63:
            raise ValueError(f"transfer id {self.transfer_id} is not a non-negative int64")
        if any(size < 0 for size in self.frame_bytes):
            raise ValueError(f"negative frame size in {self.frame_bytes}")

    @property
    def total_bytes(self) -> int:
        return sum(self.frame_bytes)

    def pack(self) -> bytes:
        return _FORMAT.pack(MAGIC, self.transfer_id, len(self.frame_bytes), self.total_bytes,
                            _sizes_digest(self.frame_bytes), int(self.checksummed))

    def check(self, received: bytes) -> None:
        """Raise FrameMismatch, naming every difference, unless ``received`` announces this transfer."""
        if len(received) != HEADER_BYTES:
            raise FrameMismatch(f"transfer header of {len(received)} bytes, expected {HEADER_BYTES}")
        magic, transfer_id, num_frames, total_bytes, digest, checksummed = _FORMAT.unpack(received)
        if magic != MAGIC:
            raise FrameMismatch("the peer's first frame is not a kvroute transfer header")
        differences = [
            f"{what} {got}, expected {wanted}"
            for what, got, wanted in (("transfer id", transfer_id, self.transfer_id),
                                      ("frame count", num_frames, len(self.frame_bytes)),
                                      ("total bytes", total_bytes, self.total_bytes),
                                      ("checksums", checksummed, int(self.checksummed)))
            if got != wanted
        ]
        if not differences and digest != _sizes_digest(self.frame_bytes):
            differences.append("frame sizes differ (same count and total)")
        if differences:
            raise FrameMismatch("the peer announced a different transfer: " + "; ".join(differences))
