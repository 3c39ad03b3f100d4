"""GPU check, part one: the paged cache's gather, scatter and copies on one device.

For each of vLLM's GPU layouts (block dimension 0, FlashInfer's ``(num_blocks, 2, …)``,
and 1, FlashAttention's ``(2, num_blocks, …)``) and each dtype this torch has, it fills
a ``PagedKVCache`` with random bytes (any bit pattern, NaNs included), then

* round-trips blocks bit-exactly: ``gather_layer`` from one cache, ``scatter_layer`` into
  another at other block ids, and ``copy_blocks``, compared byte for byte, once with the
  block ids in host memory (as the connector builds them) and once on the device;
* times ``gather_layer`` and ``scatter_layer`` against raw torch moving the same bytes
  (``index_select`` / ``index_copy_`` in the cache's own shape and element width, and a
  contiguous ``copy_`` of the same byte count as the ceiling); median of ``reps`` runs
  after a warm-up, timed with CUDA events on a GPU.

Ratio = raw seconds / kvroute seconds, so 1.0 is parity and the target is 0.8.
Runs on any device; on the CPU it only exercises the logic (the tests do that).
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from transfer.kv_layout import PagedKVCache, block_index_tensor

TARGET_RATIO = 0.8


@dataclass(frozen=True)
class CopySizes:
    num_layers: int
    num_blocks: int  # per layer
    moved_blocks: int  # per transfer, at random block ids
    block_size: int  # tokens per block
    num_kv_heads: int
    head_size: int


GPU_COPY_SIZES = CopySizes(num_layers=4, num_blocks=2048, moved_blocks=1024, block_size=16, num_kv_heads=8,
                           head_size=128)
CPU_COPY_SIZES = CopySizes(num_layers=2, num_blocks=16, moved_blocks=6, block_size=4, num_kv_heads=2, head_size=8)


def available_dtypes() -> list[torch.dtype]:
    """The dtypes a KV cache comes in, as far as this torch build has them."""
    names = ("bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2")
    return [getattr(torch, name) for name in names if hasattr(torch, name)]


def layer_shape(sizes: CopySizes, block_dim: int) -> tuple[int, ...]:
    per_block = (sizes.block_size, sizes.num_kv_heads, sizes.head_size)
    if block_dim == 0:
        return (sizes.num_blocks, 2, *per_block)
    return (2, sizes.num_blocks, *per_block)


def random_layers(sizes: CopySizes, block_dim: int, dtype: torch.dtype, device: torch.device,
                  seed: int) -> list[torch.Tensor]:
    """Layers of random bytes viewed as ``dtype``: every bit pattern, never computed on.
    Drawn on the device itself: a GiB of host randomness would take longer than the check."""
    generator = torch.Generator(device=device).manual_seed(seed)
    shape = layer_shape(sizes, block_dim)
    nbytes = torch.Size(shape).numel() * torch.empty((), dtype=dtype).element_size()
    return [torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=generator, device=device)
            .view(dtype).view(shape) for _ in range(sizes.num_layers)]


def block_bytes(layer: torch.Tensor, block_dim: int, block_ids: torch.Tensor) -> torch.Tensor:
    """The given blocks of a layer, as bytes, by plain torch (the reference for comparisons)."""
    blocks = torch.index_select(layer, block_dim, block_ids.to(layer.device))
    return blocks.contiguous().view(torch.uint8)


def round_trip_exact(source: PagedKVCache, target: PagedKVCache, source_ids: torch.Tensor,
                     target_ids: torch.Tensor) -> bool:
    """Gather from ``source``, scatter into ``target``, copy out again: all byte-identical."""
    dim = source.block_dim
    wire = torch.empty(len(source_ids) * source.layer_bytes_per_block, dtype=torch.uint8,
                       device=source.layers[0].device)
    exact = True
    for index, (before, after) in enumerate(zip(source.layers, target.layers)):
        source.gather_layer(index, source_ids, wire)
        target.scatter_layer(index, target_ids, wire)
        expected = block_bytes(before, dim, source_ids)
        exact &= torch.equal(block_bytes(after, dim, target_ids), expected)
        exact &= torch.equal(wire.view(-1), expected.view(-1))
    for copy, layer in zip(source.copy_blocks(source_ids), source.layers):
        exact &= torch.equal(copy, block_bytes(layer, dim, source_ids).view(-1))
    return bool(exact)


def median_seconds(run: Callable[[], None], device: torch.device, reps: int) -> float:
    """Median wall time of ``run`` over ``reps`` runs after one warm-up; CUDA events on a GPU."""
    run()
    samples = []
    for _ in range(reps):
        if device.type == "cuda":
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            run()
            end.record()
            end.synchronize()
            samples.append(start.elapsed_time(end) / 1000)
        else:
            started = time.perf_counter()
            run()
            samples.append(time.perf_counter() - started)
    return statistics.median(samples)


@dataclass
class CopyCase:
    """One layout and dtype: two caches, the block ids moved, and the wire buffers."""

    source: PagedKVCache
    target: PagedKVCache
    source_ids: torch.Tensor  # on the device
    target_ids: torch.Tensor
    wires: list[torch.Tensor]  # one per layer, contiguous bytes

    @property
    def moved_bytes(self) -> int:
        return sum(wire.numel() for wire in self.wires)


def make_case(sizes: CopySizes, block_dim: int, dtype: torch.dtype, device: torch.device, seed: int) -> CopyCase:
    generator = torch.Generator().manual_seed(seed)
    caches = [PagedKVCache(random_layers(sizes, block_dim, dtype, device, seed + cache), sizes.num_blocks,
                           sizes.block_size) for cache in range(2)]
    ids = [torch.randperm(sizes.num_blocks, generator=generator)[:sizes.moved_blocks].to(device) for _ in range(2)]
    wires = [torch.empty(sizes.moved_blocks * caches[0].layer_bytes_per_block, dtype=torch.uint8, device=device)
             for _ in range(sizes.num_layers)]
    return CopyCase(caches[0], caches[1], ids[0], ids[1], wires)


def timed_copies(case: CopyCase, device: torch.device, reps: int) -> dict[str, float]:
    """Median seconds to move every layer's blocks, kvroute's way and raw torch's."""
    source, target, dim = case.source, case.target, case.source.block_dim
    raw_sources, raw_targets = [native_width(layer) for layer in source.layers], \
        [native_width(layer) for layer in target.layers]
    raw_wires = [torch.index_select(layer, dim, case.source_ids) for layer in raw_sources]
    flat_source = [layer.view(-1).view(torch.uint8)[:wire.numel()] for layer, wire in zip(source.layers, case.wires)]

    def each_layer(step: Callable[[int], None]) -> Callable[[], None]:
        return lambda: [step(index) for index in range(len(source.layers))]

    return {
        "gather": median_seconds(each_layer(lambda i: source.gather_layer(i, case.source_ids, case.wires[i])),
                                 device, reps),
        "raw_index_select": median_seconds(each_layer(lambda i: torch.index_select(
            raw_sources[i], dim, case.source_ids, out=raw_wires[i])), device, reps),
        "scatter": median_seconds(each_layer(lambda i: target.scatter_layer(i, case.target_ids, case.wires[i])),
                                  device, reps),
        "raw_index_copy": median_seconds(each_layer(lambda i: raw_targets[i].index_copy_(
            dim, case.target_ids, raw_wires[i])), device, reps),
        "raw_contiguous_copy": median_seconds(each_layer(lambda i: case.wires[i].copy_(flat_source[i])),
                                              device, reps),
    }


_INTEGER_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


def native_width(layer: torch.Tensor) -> torch.Tensor:
    """The layer in its own shape and element width, as integers: what raw torch moves it in.
    (Indexed copies are not implemented for float8 on every device; integers always are.)"""
    return layer.view(_INTEGER_OF_WIDTH[layer.element_size()])


def ratios(seconds: dict[str, float]) -> dict[str, float]:
    """Raw over kvroute: >= 1 means kvroute is as fast as raw torch."""
    return {"gather_vs_index_select": seconds["raw_index_select"] / seconds["gather"],
            "scatter_vs_index_copy": seconds["raw_index_copy"] / seconds["scatter"],
            "gather_vs_contiguous_copy": seconds["raw_contiguous_copy"] / seconds["gather"],
            "scatter_vs_contiguous_copy": seconds["raw_contiguous_copy"] / seconds["scatter"]}


def check_case(sizes: CopySizes, block_dim: int, dtype: torch.dtype, device: torch.device, reps: int,
               seed: int = 0) -> dict:
    """One row of the report: bit-exactness, medians, throughput and ratios."""
    case = make_case(sizes, block_dim, dtype, device, seed)
    exact_device_ids = round_trip_exact(case.source, case.target, case.source_ids, case.target_ids)
    host_ids = [block_index_tensor(ids.tolist()) for ids in (case.source_ids, case.target_ids)]
    exact_host_ids = round_trip_exact(case.source, case.target, *host_ids)
    seconds = timed_copies(case, device, reps)
    row_ratios = ratios(seconds)
    return {"check": "copies", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
            "block_dim": block_dim, "layer_shape": list(case.source.layers[0].shape),
            "moved_bytes": case.moved_bytes, "bit_exact": exact_device_ids and exact_host_ids,
            "seconds": seconds, "gb_per_second": {name: case.moved_bytes / value / 1e9
                                                  for name, value in seconds.items()},
            "ratios": row_ratios, "target_ratio": TARGET_RATIO,
            "meets_target": min(row_ratios["gather_vs_index_select"],
                                row_ratios["scatter_vs_index_copy"]) >= TARGET_RATIO}


def check_copies(device: torch.device, sizes: CopySizes, reps: int) -> list[dict]:
    rows = []
    for dtype in available_dtypes():
        for block_dim in (0, 1):
            try:
                rows.append(check_case(sizes, block_dim, dtype, device, reps))
            except Exception as error:  # one unsupported dtype must not hide the other rows
                rows.append({"check": "copies", "device": str(device), "dtype": str(dtype).removeprefix("torch."),
                             "block_dim": block_dim, "bit_exact": False, "meets_target": False,
                             "error": f"{type(error).__name__}: {error}"})
    return rows
