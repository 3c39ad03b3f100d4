"""Reading and writing whole blocks of vLLM's paged KV cache, whatever its layout.

vLLM hands the connector one tensor per attention layer. Where the block dimension
sits depends on the attention backend (the CPU backend's layout differs from the GPU
ones), so it is read from the tensors, never assumed. Gather and scatter are one
vectorised ``index_select`` / ``index_copy_`` per layer: no per-block Python loop.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from kvroute.wire import KVLayoutSpec


class LayoutMismatch(ValueError):
    """Two engines whose KV caches cannot exchange blocks byte for byte."""


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
        if remote != self.spec:
            raise LayoutMismatch(f"KV layout differs: local {self.spec}, remote {remote}")

    def gather_layer(self, layer_index: int, block_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Copy the given blocks of one layer, in order, into the contiguous ``out``."""
        layer = self.layers[layer_index]
        shape = list(layer.shape)
        shape[self.block_dim] = len(block_ids)
        torch.index_select(layer, self.block_dim, block_ids, out=out.view(layer.dtype).view(shape))

    def scatter_layer(self, layer_index: int, block_ids: torch.Tensor, data: torch.Tensor) -> None:
        """Write contiguous blocks (as produced by ``gather_layer``) into one layer."""
        layer = self.layers[layer_index]
        shape = list(layer.shape)
        shape[self.block_dim] = len(block_ids)
        layer.index_copy_(self.block_dim, block_ids, data.view(layer.dtype).view(shape))


def block_index_tensor(block_ids: Sequence[int]) -> torch.Tensor:
    return torch.tensor(list(block_ids), dtype=torch.long)
