"""PagedKVCache: whole blocks move bit-exactly between caches of any dtype and layout,
and only the requested blocks are written."""

from __future__ import annotations

import math

import pytest
import torch

from foundation.wire import KVLayoutSpec
from transfer.kv_layout import LayoutMismatch, PagedKVCache, block_index_tensor, find_block_dim, widest_element

NUM_LAYERS = 3
NUM_HEADS = 3
BLOCK_SIZE = 4
HEAD_DIM = 8
SRC_BLOCKS = 11
DST_BLOCKS = 13  # engines may differ in block count and still exchange blocks

DTYPES = [
    pytest.param(torch.float32, id="float32"),
    pytest.param(torch.bfloat16, id="bfloat16"),
    pytest.param(torch.float16, id="float16"),
    pytest.param(torch.int8, id="int8"),
    # vLLM stores fp8 KV caches ("fp8", "fp8_e4m3", "fp8_e5m2") as uint8 tensors.
    pytest.param(torch.uint8, id="uint8-fp8-cache"),
    pytest.param(torch.int16, id="int16"),
]


def _block_at_0(num_blocks):
    """(num_blocks, 2, H, B, C), e.g. the CPU backend."""
    return (num_blocks, 2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM), 0, None


def _block_at_1(num_blocks):
    """(2, num_blocks, H, B, C), e.g. FlashAttention."""
    return (2, num_blocks, NUM_HEADS, BLOCK_SIZE, HEAD_DIM), 1, None


def _permuted(num_blocks):
    """A non-contiguous view: stored (num_blocks, 2, B, H, C), seen as (num_blocks, 2, H, B, C)."""
    return (num_blocks, 2, BLOCK_SIZE, NUM_HEADS, HEAD_DIM), 0, (0, 1, 3, 2, 4)


LAYOUTS = [
    pytest.param(_block_at_0, id="block-dim-0"),
    pytest.param(_block_at_1, id="block-dim-1"),
    pytest.param(_permuted, id="permuted-view"),
]


def random_layer(shape, dtype, generator, permute=None) -> torch.Tensor:
    """Random bit patterns (NaNs included for floats) viewed as ``dtype``."""
    itemsize = torch.empty((), dtype=dtype).element_size()
    raw = torch.randint(0, 256, (*shape[:-1], shape[-1] * itemsize), dtype=torch.uint8, generator=generator)
    layer = raw.view(dtype)
    return layer.permute(permute) if permute else layer


def zero_layer(shape, dtype, permute=None) -> torch.Tensor:
    layer = torch.zeros(shape, dtype=dtype)
    return layer.permute(permute) if permute else layer


def make_cache(layout, dtype, num_blocks, *, random: bool, seed: int = 0) -> PagedKVCache:
    shape, _, permute = layout(num_blocks)
    generator = torch.Generator().manual_seed(seed)
    layers = [random_layer(shape, dtype, generator, permute) if random else zero_layer(shape, dtype, permute)
              for _ in range(NUM_LAYERS)]
    return PagedKVCache(layers, num_blocks, BLOCK_SIZE)


def block_bytes(cache: PagedKVCache, layer: int, block_id: int) -> torch.Tensor:
    return cache.layers[layer].select(cache.block_dim, block_id).contiguous().view(torch.uint8)


def transfer(src: PagedKVCache, src_ids, dst: PagedKVCache, dst_ids) -> None:
    """What a pull does: gather each layer into a contiguous buffer, scatter it remotely."""
    src_index, dst_index = block_index_tensor(src_ids), block_index_tensor(dst_ids)
    for layer in range(src.spec.num_layers):
        buffer = torch.empty(len(src_ids) * src.layer_bytes_per_block, dtype=torch.uint8)
        src.gather_layer(layer, src_index, buffer)
        dst.scatter_layer(layer, dst_index, buffer)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", DTYPES)
def test_gather_scatter_round_trips_bit_exactly(layout, dtype):
    src = make_cache(layout, dtype, SRC_BLOCKS, random=True, seed=1)
    dst = make_cache(layout, dtype, DST_BLOCKS, random=False)
    src.check_compatible(dst.spec)
    src_ids = [7, 0, 3, 10, 5]  # arbitrary order
    dst_ids = [12, 2, 9, 1, 4]
    transfer(src, src_ids, dst, dst_ids)

    for layer in range(NUM_LAYERS):
        for src_id, dst_id in zip(src_ids, dst_ids):
            assert torch.equal(block_bytes(dst, layer, dst_id), block_bytes(src, layer, src_id)), (layer, src_id)
        # Delta: only the requested blocks were written.
        for block_id in set(range(DST_BLOCKS)) - set(dst_ids):
            assert not block_bytes(dst, layer, block_id).any(), (layer, block_id)


@pytest.mark.parametrize("layout", LAYOUTS)
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.int8], ids=str)
def test_source_blocks_are_not_modified_by_gather(layout, dtype):
    src = make_cache(layout, dtype, SRC_BLOCKS, random=True, seed=2)
    before = [layer.clone() for layer in src.layers]
    buffer = torch.empty(4 * src.layer_bytes_per_block, dtype=torch.uint8)
    for layer in range(NUM_LAYERS):
        src.gather_layer(layer, block_index_tensor([1, 2, 3, 4]), buffer)
    for layer, original in zip(src.layers, before):
        assert torch.equal(layer.view(torch.uint8), original.view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_gathered_buffer_is_the_blocks_in_request_order(layout):
    """The wire format: per layer, the blocks as index_select lays them out."""
    src = make_cache(layout, torch.float16, SRC_BLOCKS, random=True, seed=3)
    ids = [9, 2, 2, 6]  # a repeated id is just copied twice
    buffer = torch.empty(len(ids) * src.layer_bytes_per_block, dtype=torch.uint8)
    for layer in range(NUM_LAYERS):
        src.gather_layer(layer, block_index_tensor(ids), buffer)
        expected = torch.index_select(src.layers[layer], src.block_dim, block_index_tensor(ids)).contiguous()
        assert torch.equal(buffer, expected.view(-1).view(torch.uint8))


@pytest.mark.parametrize("layout", LAYOUTS)
def test_scatter_rewrites_only_the_target_blocks_of_a_populated_cache(layout):
    src = make_cache(layout, torch.bfloat16, SRC_BLOCKS, random=True, seed=4)
    dst = make_cache(layout, torch.bfloat16, DST_BLOCKS, random=True, seed=5)
    before = [layer.clone() for layer in dst.layers]
    transfer(src, [4, 8], dst, [0, 12])
    for layer in range(NUM_LAYERS):
        assert torch.equal(block_bytes(dst, layer, 0), block_bytes(src, layer, 4))
        assert torch.equal(block_bytes(dst, layer, 12), block_bytes(src, layer, 8))
        for block_id in range(1, 12):
            original = before[layer].select(dst.block_dim, block_id).contiguous().view(torch.uint8)
            assert torch.equal(block_bytes(dst, layer, block_id), original)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_a_whole_copy_is_sent_as_it_lies_and_a_part_only_when_contiguous(layout):
    """A staged copy is in wire format: all of it goes out without a copy in every layout;
    a run of some of its blocks is a view only when blocks are the outer dimension."""
    src = make_cache(layout, torch.bfloat16, SRC_BLOCKS, random=True, seed=6)
    ids = [7, 1, 4, 9]
    copy = src.copy_blocks(block_index_tensor(ids))[0]
    whole = src.run_of_copy(copy, 0, len(ids))
    assert whole is not None and whole.data_ptr() == copy.data_ptr() and whole.numel() == copy.numel()
    part = src.run_of_copy(copy, 1, 2)
    if src.block_dim == 0:
        buffer = torch.empty(2 * src.layer_bytes_per_block, dtype=torch.uint8)
        src.gather_layer(0, block_index_tensor(ids[1:3]), buffer)
        assert part is not None and torch.equal(part, buffer)
    else:
        assert part is None


def test_empty_transfer_writes_nothing():
    src = make_cache(_block_at_1, torch.float32, SRC_BLOCKS, random=True)
    dst = make_cache(_block_at_1, torch.float32, DST_BLOCKS, random=False)
    transfer(src, [], dst, [])
    assert all(not layer.any() for layer in dst.layers)


# ---------------------------------------------------------------- the spec


SPEC_CASES = [
    pytest.param(_block_at_0, torch.float32, 0, [2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM], id="dim0-float32"),
    pytest.param(_block_at_1, torch.bfloat16, 1, [2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM], id="dim1-bfloat16"),
    pytest.param(_block_at_1, torch.int8, 1, [2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM], id="dim1-int8"),
    pytest.param(_permuted, torch.float16, 0, [2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM], id="permuted-float16"),
]


@pytest.mark.parametrize("layout, dtype, block_dim, block_shape", SPEC_CASES)
def test_spec(layout, dtype, block_dim, block_shape):
    cache = make_cache(layout, dtype, SRC_BLOCKS, random=False)
    itemsize = torch.empty((), dtype=dtype).element_size()
    layer_bytes = math.prod(block_shape) * itemsize
    assert cache.spec == KVLayoutSpec(dtype=str(dtype).removeprefix("torch."), num_layers=NUM_LAYERS,
                                      block_dim=block_dim, block_shape=block_shape, block_size=BLOCK_SIZE,
                                      bytes_per_block=layer_bytes * NUM_LAYERS)
    assert cache.block_dim == block_dim
    assert cache.layer_bytes_per_block == layer_bytes
    # bytes_per_block is what one block of every layer really occupies.
    assert cache.layer_bytes_per_block * SRC_BLOCKS == cache.layers[0].numel() * itemsize


def test_specs_of_equal_layouts_are_equal_regardless_of_block_count():
    a = make_cache(_block_at_1, torch.bfloat16, SRC_BLOCKS, random=True)
    b = make_cache(_block_at_1, torch.bfloat16, DST_BLOCKS, random=False)
    assert a.spec == b.spec
    a.check_compatible(b.spec)
    b.check_compatible(a.spec)


def _spec(**changes) -> KVLayoutSpec:
    base = dict(dtype="bfloat16", num_layers=NUM_LAYERS, block_dim=1,
                block_shape=[2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM], block_size=BLOCK_SIZE,
                bytes_per_block=2 * NUM_HEADS * BLOCK_SIZE * HEAD_DIM * 2 * NUM_LAYERS)
    return KVLayoutSpec(**(base | changes))


MISMATCHES = [
    pytest.param(_spec(dtype="float16"), id="dtype-same-size"),
    pytest.param(_spec(dtype="float32"), id="dtype"),
    pytest.param(_spec(num_layers=NUM_LAYERS + 1), id="num-layers"),
    pytest.param(_spec(block_dim=0), id="block-dim"),
    pytest.param(_spec(block_shape=[2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM * 2]), id="head-dim"),
    pytest.param(_spec(block_shape=[2, BLOCK_SIZE, NUM_HEADS, HEAD_DIM]), id="transposed-shape"),
    pytest.param(_spec(block_size=BLOCK_SIZE * 2), id="block-size"),
    pytest.param(_spec(bytes_per_block=1), id="bytes-per-block"),
]


@pytest.mark.parametrize("remote", MISMATCHES)
def test_check_compatible_refuses_mismatches(remote):
    cache = make_cache(_block_at_1, torch.bfloat16, SRC_BLOCKS, random=False)
    cache.check_compatible(_spec())  # the baseline is compatible
    with pytest.raises(LayoutMismatch):
        cache.check_compatible(remote)


def test_check_compatible_names_only_the_differing_fields():
    cache = make_cache(_block_at_1, torch.bfloat16, SRC_BLOCKS, random=False)
    with pytest.raises(LayoutMismatch, match=r"refusing the pull: block_size: local 4, remote 8$"):
        cache.check_compatible(_spec(block_size=BLOCK_SIZE * 2))


def test_check_compatible_between_real_caches_of_different_dtype_or_layout():
    bf16 = make_cache(_block_at_1, torch.bfloat16, SRC_BLOCKS, random=False)
    fp16 = make_cache(_block_at_1, torch.float16, SRC_BLOCKS, random=False)
    dim0 = make_cache(_block_at_0, torch.bfloat16, SRC_BLOCKS, random=False)
    for local, remote in [(bf16, fp16), (fp16, bf16), (bf16, dim0), (dim0, bf16)]:
        with pytest.raises(LayoutMismatch):
            local.check_compatible(remote.spec)


# ---------------------------------------------------------------- locating the block dim


FIND_BLOCK_DIM = [
    pytest.param((11, 2, 3, 4, 8), 11, 0, id="dim0"),
    pytest.param((2, 11, 3, 4, 8), 11, 1, id="dim1"),
    pytest.param((2, 3, 4, 8, 11), 11, 4, id="last"),
    pytest.param((1, 2), 1, 0, id="single-block"),
]


@pytest.mark.parametrize("shape, num_blocks, expected", FIND_BLOCK_DIM)
def test_find_block_dim(shape, num_blocks, expected):
    assert find_block_dim(torch.empty(shape), num_blocks) == expected


BAD_BLOCK_DIM = [
    pytest.param((4, 2, 4, 4, 8), 4, id="ambiguous"),
    pytest.param((2, 2, 3, 4, 8), 2, id="ambiguous-kv-dim"),
    pytest.param((11, 2, 3, 4, 8), 12, id="missing"),
]


@pytest.mark.parametrize("shape, num_blocks", BAD_BLOCK_DIM)
def test_ambiguous_or_missing_block_dim_raises(shape, num_blocks):
    with pytest.raises(LayoutMismatch):
        find_block_dim(torch.empty(shape), num_blocks)
    with pytest.raises(LayoutMismatch):
        PagedKVCache([torch.empty(shape)], num_blocks, BLOCK_SIZE)


def test_no_layers_raises():
    with pytest.raises(LayoutMismatch):
        PagedKVCache([], SRC_BLOCKS, BLOCK_SIZE)


def test_layers_that_differ_raise():
    shape = (SRC_BLOCKS, 2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM)
    with pytest.raises(LayoutMismatch):
        PagedKVCache([torch.zeros(shape), torch.zeros(shape, dtype=torch.float16)], SRC_BLOCKS, BLOCK_SIZE)
    with pytest.raises(LayoutMismatch):
        PagedKVCache([torch.zeros(shape), torch.zeros((SRC_BLOCKS, 2, NUM_HEADS, BLOCK_SIZE, HEAD_DIM + 1))],
                     SRC_BLOCKS, BLOCK_SIZE)


def test_block_index_tensor_is_long():
    assert block_index_tensor([3, 1]).dtype == torch.long
    assert block_index_tensor([]).dtype == torch.long
    assert block_index_tensor(range(3)).tolist() == [0, 1, 2]


@pytest.mark.parametrize("row_bytes, offset, expected", [
    (98_304, 0, torch.complex128),  # a bf16 CPU block of SmolLM2: 2 x 3 heads x 128 x 64
    (24, 0, torch.int64),
    (12, 0, torch.int32),
    (6, 0, torch.int16),
    (3, 0, torch.uint8),
    (64, 4, torch.int32),  # a start address off the wider alignments
])
def test_widest_element(row_bytes, offset, expected):
    storage = torch.zeros(4 * row_bytes + 64, dtype=torch.uint8)
    base = (-storage.data_ptr()) % 16  # a 16-byte aligned start, then the offset under test
    rows = storage[base + offset: base + offset + 4 * row_bytes].view(4, row_bytes)
    assert widest_element(rows) == expected


def test_odd_sized_blocks_still_move_bit_exactly():
    """Rows of 3 bytes admit no wide element; the byte path must be just as exact."""
    src = PagedKVCache([torch.randint(0, 256, (7, 3), dtype=torch.uint8) for _ in range(2)], 7, 3)
    dst = PagedKVCache([torch.zeros(9, 3, dtype=torch.uint8) for _ in range(2)], 9, 3)
    transfer(src, [6, 0, 2], dst, [1, 8, 4])
    for s, d in zip(src.layers, dst.layers):
        assert torch.equal(d[[1, 8, 4]], s[[6, 0, 2]])
        assert not d[[0, 2, 3, 5, 6, 7]].any()
