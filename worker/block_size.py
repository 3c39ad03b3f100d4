"""Choosing the KV block size when the user leaves it unset.

A block is the unit of prefix reuse: vLLM caches and matches whole blocks only, so a
request reuses a shared prefix rounded down to a block and recomputes the rest of it
along with its own suffix. vLLM's CPU default is 128 tokens, so every cache hit also
recomputes, on average, 64 tokens of the shared prefix's tail; on CPU that is most of a
hit's prefill. kvroute therefore asks for 32-token blocks on CPUs (vLLM's CPU attention
wants a multiple of 32) and keeps vLLM's own default (16) on GPUs.

Measured on a 2-core x86 machine (SmolLM2-135M, float32, one core): a request sharing a
765-1,352-token prefix, with a 40-token question, took 330-465 ms to its first token with
128-token blocks and 190-250 ms with 32-token blocks; a cold prefill of the same prompt
took 3-5% longer with 32, a decode step over 1,400-token contexts 2-6% longer.
"""

from __future__ import annotations

CPU_BLOCK_SIZE = 32


def resolve_block_size(requested: int | None, cuda_available: bool) -> int | None:
    """The block size to ask the engine for; None leaves it to vLLM."""
    if requested is not None:
        return requested
    return None if cuda_available else CPU_BLOCK_SIZE


def resolve_here(requested: int | None) -> int | None:
    """``resolve_block_size`` for this machine."""
    if requested is not None:
        return requested
    import torch

    return resolve_block_size(requested, torch.cuda.is_available())
