"""Reading and writing whole blocks of vLLM's paged KV cache, whatever its layout.

vLLM hands the connector one tensor per attention layer. Where the block dimension
sits depends on the attention backend (the CPU backend's layout differs from the GPU
ones), so it is read from the tensors, never assumed. Gather and scatter are one
vectorised copy per layer, no per-block Python loop: ``index_select`` in wide elements
for gathers (see ``PagedKVCache._views``), and for scatters into host memory numpy's
row-wise fancy assignment. Blocks always move as opaque bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch

from foundation.wire import KVLayoutSpec


class LayoutMismatch(ValueError):
    """Two engines whose KV caches cannot exchange blocks byte for byte."""


def layout_differences(local: KVLayoutSpec, remote: KVLayoutSpec) -> list[str]:
    """Each field in which two layouts differ, as 'field: local …, remote …'."""
    return [f"{field}: local {getattr(local, field)!r}, remote {getattr(remote, field)!r}"
            for field in local.__struct_fields__ if getattr(local, field) != getattr(remote, field)]


def check_layouts(local: KVLayoutSpec, remote: KVLayoutSpec, refusing: str) -> None:
    """Raise LayoutMismatch naming every differing field; ``refusing`` says what is refused."""
    differences = layout_differences(local, remote)
    if differences:
        # block_shape holds the heads, block size and head size in the engine's own order.
        raise LayoutMismatch(f"KV cache layouts differ, refusing {refusing}: " + "; ".join(differences))


def find_block_dim(tensor: torch.Tensor, num_blocks: int) -> int:
    """The one dimension of a layer's cache whose size is the engine's block count."""
    candidates = [dim for dim, size in enumerate(tensor.shape) if size == num_blocks]
    if len(candidates) != 1:
        raise LayoutMismatch(
            f"cannot locate the block dimension in a KV cache of shape "
            f"{tuple(tensor.shape)} with {num_blocks} blocks"
        )
    return candidates[0]


class PagedKVCache:
    """The engine's per-layer KV tensors plus the facts needed to move blocks.

    Owned by the worker-side connector; it only reads blocks it was told are held
    (producer) or writes blocks allocated for a pending load (consumer).
    """

    def __init__(self, layers: Sequence[torch.Tensor], num_blocks: int, block_size: int):
        if not layers:
            raise LayoutMismatch("the engine registered no KV cache layers")
        self.layers = list(layers)
        self.block_dim = find_block_dim(self.layers[0], num_blocks)
        self.num_blocks = num_blocks
        first_shape = self._block_shape(self.layers[0])
        for layer in self.layers[1:]:
            if self._block_shape(layer) != first_shape or layer.dtype != self.layers[0].dtype:
                raise LayoutMismatch("KV cache layers differ in shape or dtype")
        self.spec = KVLayoutSpec(
            dtype=str(self.layers[0].dtype).removeprefix("torch."),
            num_layers=len(self.layers),
            block_dim=self.block_dim,
            block_shape=first_shape,
            block_size=block_size,
            bytes_per_block=self._layer_bytes_per_block() * len(self.layers),
        )
        self._rows: list | None = None  # see _layer_rows

    def _block_shape(self, layer: torch.Tensor) -> list[int]:
        shape = list(layer.shape)
        del shape[self.block_dim]
        return shape

    def _layer_bytes_per_block(self) -> int:
        layer = self.layers[0]
        return layer.numel() // self.num_blocks * layer.element_size()

    @property
    def layer_bytes_per_block(self) -> int:
        return self.spec.bytes_per_block // self.spec.num_layers

    def check_compatible(self, remote: KVLayoutSpec) -> None:
        check_layouts(self.spec, remote, refusing="the pull")

    @property
    def device(self) -> torch.device:
        return self.layers[0].device

    @property
    def is_host_memory(self) -> bool:
        return self.device.type == "cpu"

    def gather_layer(self, layer_index: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the given blocks of one layer, in order, into the contiguous ``out``."""
        layer, wire = self._views(layer_index, out, len(block_ids))
        torch.index_select(layer, self.block_dim, _on_device(block_ids, layer), out=wire)

    def scatter_layer(self, layer_index: int, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Write contiguous blocks (as produced by ``gather_layer``) into one layer."""
        layer = self.layers[layer_index]
        if layer.is_contiguous() and layer.device.type == "cpu":
            # numpy's fancy assignment copies whole rows with memcpy whatever their alignment;
            # received frames are often only 8-byte aligned, which halves the wide-element path.
            rows = self._wire_rows(layer, self.num_blocks).numpy()
            rows[(slice(None),) * self.block_dim + (block_ids.numpy(),)] = self._wire_rows(data, len(block_ids)).numpy()
            return
        layer, wire = self._views(layer_index, data, len(block_ids))
        layer.index_copy_(self.block_dim, _on_device(block_ids, layer), wire)

    def _views(self, layer_index: int, wire: torch.Tensor, num_blocks: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The layer and a wire buffer of ``num_blocks`` blocks, viewed alike for copying.

        Only bytes move, so a contiguous layer is viewed as rows of the widest element
        that divides a block's bytes and both start addresses: indexed copies then move
        16 bytes per element instead of 2, several times faster on CPU. A non-contiguous
        layer keeps its own dtype and shape."""
        layer = self.layers[layer_index]
        if not layer.is_contiguous():
            shape = list(layer.shape)
            shape[self.block_dim] = num_blocks
            return layer, wire.view(layer.dtype).view(shape)
        layer_rows = self._wire_rows(layer, self.num_blocks)
        wire_rows = self._wire_rows(wire, num_blocks)
        element = widest_element(layer_rows, wire_rows)
        return layer_rows.view(element), wire_rows.view(element)

    def _wire_rows(self, data: torch.Tensor, num_blocks: int) -> torch.Tensor:
        """Contiguous ``data`` holding ``num_blocks`` blocks, as bytes: the dimensions up to
        the block dimension, then one row of everything after it."""
        shape = list(self.layers[0].shape)
        shape[self.block_dim] = num_blocks
        row_bytes = math.prod(shape[self.block_dim + 1:]) * self.layers[0].element_size()
        return data.view(torch.uint8).view(*shape[: self.block_dim + 1], row_bytes)

    # ------------------------------------------------------------ copies (staged leases)

    def copy_blocks(self, block_ids: torch.Tensor, into: torch.Tensor | None = None) -> tuple[torch.Tensor, ...]:
        """Every layer's given blocks, in order, as contiguous byte tensors (wire format):
        new ones, or consecutive slices of ``into`` (bytes, one layer after another)."""
        nbytes = len(block_ids) * self.layer_bytes_per_block
        copies = []
        for layer in range(self.spec.num_layers):
            if into is None:
                # On the cache's own device: an indexed copy cannot write across devices.
                out = torch.empty(nbytes, dtype=torch.uint8, device=self.layers[layer].device)
            else:
                out = into[layer * nbytes:(layer + 1) * nbytes]
            self.gather_layer(layer, block_ids, out)
            copies.append(out)
        return tuple(copies)

    def row_geometry(self) -> tuple[int, int]:
        """(rows per block under the leading indices, e.g. 2 for keys then values; bytes of one
        such row) of a contiguous layer: block b's row r starts at ``(r * num_blocks + b) * row_bytes``."""
        rows = self._wire_rows(self.layers[0], self.num_blocks)
        return math.prod(rows.shape[:-2]), rows.shape[-1]

    def rows_of_runs(self, layer_index: int, local_block_ids: Sequence[int], positions: Sequence[int],
                     copy_blocks: int) -> list[tuple[int, list[memoryview]]]:
        """Where blocks ``positions`` of a copy of ``copy_blocks`` blocks (one layer of
        ``copy_blocks``' output) land in this layer, at ``local_block_ids``: for each run of
        consecutive positions under each leading index (e.g. keys, then values), the run's
        byte offset in the copy and the destination rows it fills, in order. Consecutive
        local blocks share one buffer. Host-memory, contiguous layers only."""
        layer = self.layers[layer_index]
        if not (layer.is_contiguous() and layer.device.type == "cpu"):
            raise LayoutMismatch("reading a copy into rows needs a contiguous host-memory cache")
        _check_range(positions, copy_blocks, "position")
        _check_range(local_block_ids, self.num_blocks, "block id")
        rows = self._wire_rows(layer, self.num_blocks)
        row_bytes = rows.shape[-1]
        rows = rows.reshape(-1, self.num_blocks, row_bytes).numpy()
        runs = consecutive_runs(positions, local_block_ids)
        return [((lead * copy_blocks + first_position) * row_bytes,
                 [memoryview(rows[lead, first:first + count]) for first, count in segments])
                for lead in range(rows.shape[0]) for first_position, segments in runs]

    def block_rows(self, block_id: int) -> list[memoryview]:
        """Where one block lies in this cache, as ``gather_layer`` of that block writes it,
        layer after layer: per layer, its row under each leading index (e.g. keys, then
        values). Host-memory, contiguous layers only."""
        _check_range((block_id,), self.num_blocks, "block id")
        return [memoryview(row) for rows in self._layer_rows() for row in rows[:, block_id]]

    def _layer_rows(self) -> list:
        """Per layer, its bytes as a numpy array (leading index, block, row); built once."""
        if self._rows is None:
            if not all(layer.is_contiguous() and layer.device.type == "cpu" for layer in self.layers):
                raise LayoutMismatch("reading rows needs a contiguous host-memory cache")
            self._rows = []
            for layer in self.layers:
                rows = self._wire_rows(layer, self.num_blocks)
                self._rows.append(rows.reshape(-1, self.num_blocks, rows.shape[-1]).numpy())
        return self._rows

    def run_of_copy(self, copy: torch.Tensor, first: int, count: int) -> torch.Tensor | None:
        """Blocks ``first … first+count-1`` of a copy as a view in wire format, when they lie
        contiguously: all of the copy's blocks (a copy is in wire format), or any run when
        the block dimension comes first; None otherwise (e.g. a suffix of a layout whose
        keys and values are split before the block dimension)."""
        block_bytes = self.layer_bytes_per_block
        if first == 0 and count * block_bytes == copy.numel():
            return copy
        if self.block_dim != 0:
            return None
        return copy[first * block_bytes:(first + count) * block_bytes]

    def select_from_copy(self, copy: torch.Tensor, positions: torch.Tensor, out: torch.Tensor) -> None:
        """Blocks at ``positions`` of a copy made by ``copy_blocks``, into ``out`` (wire format)."""
        source = self._wire_rows(copy, copy.numel() // self.layer_bytes_per_block)
        target = self._wire_rows(out, len(positions))
        element = widest_element(source, target)
        torch.index_select(source.view(element), self.block_dim, positions, out=target.view(element))


# Plain-copy element types by width; complex128 moves 16 bytes at a time and is never
# computed on, so NaN payloads and any bit pattern survive unchanged.
_WIDE_ELEMENTS = (torch.complex128, torch.int64, torch.int32, torch.int16)


def widest_element(*byte_rows: torch.Tensor) -> torch.dtype:
    """The widest element type that every row length and start address divides."""
    for element in _WIDE_ELEMENTS:
        size = element.itemsize
        if all(t.shape[-1] % size == 0 and t.data_ptr() % size == 0 for t in byte_rows):
            return element
    return torch.uint8


def _on_device(block_ids: torch.Tensor, layer: torch.Tensor) -> torch.Tensor:
    """The block ids where the layer lives: callers build them in host memory (see
    ``block_index_tensor``), and CUDA's indexed copies want the index on the GPU.
    A no-op for host caches."""
    return block_ids.to(layer.device, non_blocking=True)


def consecutive_runs(positions: Sequence[int], local_ids: Sequence[int]) -> list[tuple[int, list[tuple[int, int]]]]:
    """Pairs (position, local id) grouped into runs of consecutive positions: per run its
    first position and its (first local id, count) segments of consecutive local ids."""
    runs: list[tuple[int, list[tuple[int, int]]]] = []
    previous: tuple[int, int] | None = None
    for position, local in zip(positions, local_ids, strict=True):
        if previous is not None and position == previous[0] + 1:
            segments = runs[-1][1]
            if local == previous[1] + 1:
                segments[-1] = (segments[-1][0], segments[-1][1] + 1)
            else:
                segments.append((local, 1))
        else:
            runs.append((position, [(local, 1)]))
        previous = (position, local)
    return runs


def _check_range(values: Sequence[int], limit: int, what: str) -> None:
    for value in values:
        if not 0 <= value < limit:
            raise IndexError(f"{what} {value} outside 0..{limit - 1}")


def block_index_tensor(block_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(block_ids), dtype=torch.long)
