"""How the node store lays out blocks: one slot per block, in a few large arenas of shared
memory, and files on disk. Torch-free: the store process uses numpy on byte arrays.

A slot holds one block in the wire format of ``transfer.kv_layout``, every layer after the
other: for each layer the block's rows under each leading index of the engine's layout
(e.g. keys, then values), as ``gather_layer`` of that one block writes them::

    slot = layer 0 [lead 0 row | lead 1 row] | layer 1 [...] | ... | layer L-1 [...]

A writer hands the store a staged copy of ``n`` blocks as a lease stages them (layer after
layer, each layer's rows ``(leads, n, row)``); ``staged_blocks`` views that copy so block
``i`` is ``[:, :, i, :]``, and storing it into a slot is one strided copy. A reader on
this host ``preadv``s a slot straight into its cache rows, in the same order.
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from foundation.wire import KVLayoutSpec, SharedCopyRef
from transfer.memfd import MemFile

ARENA_PREFIX = "kvroute-tier-arena-"
PUT_PREFIX = "kvroute-tier-put-"  # a writer's staged copy of the blocks it stores
ARENA_BYTES = 256 << 20  # memfds of at most this much; a store of 4 GiB has 16


class BadLayout(ValueError):
    """A layout whose bytes per block do not split into layers and rows."""


@dataclass(frozen=True)
class BlockFormat:
    num_layers: int
    leads: int  # rows per layer and block: the layout's dimensions before the block's
    row_bytes: int

    @classmethod
    def of(cls, layout: KVLayoutSpec) -> BlockFormat:
        leads = math.prod(layout.block_shape[:layout.block_dim])
        rows = layout.num_layers * leads
        if layout.num_layers < 1 or leads < 1 or layout.bytes_per_block <= 0 or layout.bytes_per_block % rows:
            raise BadLayout(f"a layout of {layout.bytes_per_block} bytes per block does not split into "
                            f"{layout.num_layers} layers of {leads} rows")
        return cls(layout.num_layers, leads, layout.bytes_per_block // rows)

    @property
    def block_bytes(self) -> int:
        return self.num_layers * self.leads * self.row_bytes

    def staged_blocks(self, data: np.ndarray, num_blocks: int) -> np.ndarray:
        """A staged copy of ``num_blocks`` blocks (bytes) as ``(layers, leads, blocks, row)``."""
        if data.nbytes != num_blocks * self.block_bytes:
            raise ValueError(f"a copy of {num_blocks} blocks holds {num_blocks * self.block_bytes} bytes, "
                             f"not {data.nbytes}")
        return data.reshape(self.num_layers, self.leads, num_blocks, self.row_bytes)

    def slot_rows(self, slot: np.ndarray) -> np.ndarray:
        """One slot (bytes) as ``(layers, leads, row)``."""
        return slot.reshape(self.num_layers, self.leads, self.row_bytes)


class Arenas:
    """The host tier's memory: ``num_slots`` slots of ``slot_bytes`` in memfds, which readers
    on this host open through /proc. The memory is taken as slots are first written."""

    def __init__(self, slot_bytes: int, num_slots: int, arena_bytes: int = ARENA_BYTES):
        self.slot_bytes = slot_bytes
        self.slots_per_arena = max(1, arena_bytes // slot_bytes)
        self.files: list[MemFile] = []
        self._views: list[np.ndarray] = []
        for first in range(0, num_slots, self.slots_per_arena):
            count = min(self.slots_per_arena, num_slots - first)
            memfile = MemFile(count * slot_bytes, ARENA_PREFIX)
            self.files.append(memfile)
            self._views.append(np.frombuffer(memfile.mapping, dtype=np.uint8).reshape(count, slot_bytes))

    def slot(self, slot: int) -> np.ndarray:
        arena, index = divmod(slot, self.slots_per_arena)
        return self._views[arena][index]

    def where(self, slot: int) -> tuple[int, int]:
        """(arena, byte offset of the slot in it)."""
        arena, index = divmod(slot, self.slots_per_arena)
        return arena, index * self.slot_bytes

    def refs(self) -> list[SharedCopyRef]:
        return [memfile.ref(view.shape[0]) for memfile, view in zip(self.files, self._views)]

    def close(self) -> None:
        self._views.clear()
        for memfile in self.files:
            memfile.close()


class DiskBlockMissing(OSError):
    """A disk block's file is gone or shorter than a block."""


class DiskTier:
    """Blocks in files ``<folder>/<slot>.blk`` under the store's own folder, which it empties
    when it starts and stops (what a previous store left has no index to trust). The folder
    and its files are its user's alone (0700, 0600): they hold every tenant's KV."""

    SUFFIX = ".blk"

    def __init__(self, folder: Path, slot_bytes: int):
        self.folder = Path(folder)
        self.slot_bytes = slot_bytes
        self.folder.mkdir(mode=0o700, parents=True, exist_ok=True)
        os.chmod(self.folder, 0o700)
        self.wipe()

    def path(self, slot: int) -> Path:
        return self.folder / f"{slot}{self.SUFFIX}"

    def write(self, slot: int, data: np.ndarray) -> None:
        fd = os.open(self.path(slot), os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        with open(fd, "wb") as file:
            file.write(memoryview(data))

    def read_into(self, slot: int, out: np.ndarray) -> None:
        try:
            with open(self.path(slot), "rb", buffering=0) as file:
                got = file.readinto(memoryview(out))
        except FileNotFoundError as error:
            raise DiskBlockMissing(f"disk block {slot} is missing") from error
        if got != self.slot_bytes:
            raise DiskBlockMissing(f"disk block {slot} holds {got} of {self.slot_bytes} bytes")

    def remove(self, slot: int) -> None:
        with_missing_ok(self.path(slot))

    def wipe(self) -> None:
        for path in self.folder.glob(f"*{self.SUFFIX}"):
            with_missing_ok(path)


def with_missing_ok(path: Path) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass
