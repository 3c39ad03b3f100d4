"""Fake paged KV caches of a few layers, in both block layouts and two dtypes, filled with random
bytes (NaN patterns included): what the transfer tests gather from and scatter into."""

from __future__ import annotations

import torch

from transfer.kv_layout import PagedKVCache

NUM_LAYERS = 3
NUM_HEADS = 4
BLOCK_SIZE = 16
HEAD_DIM = 32
PRODUCER_BLOCKS = 12
CONSUMER_BLOCKS = 10

DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}
LAYOUTS = {
    # block dimension first, e.g. vLLM's CPU backend
    "block-dim-0": lambda n: (n, 2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM),
    # K/V first, e.g. FlashAttention
    "block-dim-1": lambda n: (2, n, NUM_HEADS, BLOCK_SIZE, HEAD_DIM),
}


def make_cache(dtype: torch.dtype, layout: str, num_blocks: int, seed: int | None) -> PagedKVCache:
    shape = LAYOUTS[layout](num_blocks)
    if seed is None:
        layers = [torch.zeros(shape, dtype=dtype) for _ in range(NUM_LAYERS)]
    else:
        generator = torch.Generator().manual_seed(seed)
        itemsize = torch.empty((), dtype=dtype).element_size()
        layers = [torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8,
                                generator=generator).view(dtype) for _ in range(NUM_LAYERS)]
    return PagedKVCache(layers, num_blocks, BLOCK_SIZE)


def snapshot(cache: PagedKVCache) -> list[torch.Tensor]:
    return [layer.clone() for layer in cache.layers]


def block_bytes(cache: PagedKVCache, layer: int, block_id: int) -> torch.Tensor:
    return cache.layers[layer].select(cache.block_dim, block_id).contiguous().view(torch.uint8)
