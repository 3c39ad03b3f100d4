"""Reordering vLLM's free block queue so that given cached blocks are evicted first.

vLLM's ``FreeKVCacheBlockQueue`` is one doubly linked list of free blocks. Allocation
takes from its front, evicting a block's cached prefix when the block holds one; freed
blocks that cache nothing go to the front (used before anything cached is evicted), and
cached ones to the back, so the cached blocks form an LRU order behind a leading run of
blocks that cache nothing. ``demote`` moves blocks to just behind that run: the first
cached blocks to be evicted, but never before a block whose reuse costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

# Queue entries ``demote`` looks at. A longer run of free blocks that cache nothing means
# no cached block is evicted for at least that many allocations: try again later.
SCAN_LIMIT = 1024


def demote(queue: Any, blocks: Sequence[Any], scan_limit: int = SCAN_LIMIT) -> bool:
    """Move ``blocks`` (free and cached, in the order they should go) in front of every
    other cached block in ``queue``. False, and nothing moved, when more than
    ``scan_limit`` blocks that cache nothing lead the queue."""
    if not blocks:
        return True
    ours = {id(block) for block in blocks}
    node = queue.fake_free_list_head.next_free_block
    for _ in range(scan_limit):
        if node is queue.fake_free_list_tail or (node.block_hash is not None and id(node) not in ours):
            break
        node = node.next_free_block
    else:
        return False
    if node is queue.fake_free_list_tail:
        return True  # no other cached block is free: nothing is evicted before ours anyway
    for block in blocks:
        queue.remove(block)
    before = node.prev_free_block
    for block in blocks:
        before.next_free_block, block.prev_free_block = block, before
        before = block
    before.next_free_block, node.prev_free_block = node, before
    queue.num_free_blocks += len(blocks)
    return True
