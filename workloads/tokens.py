"""Deterministic pseudo-random token ids, for prompts that must share exactly what they should.

A label (bytes) always expands to the same ids, on every machine and Python version: the
ids are the SHAKE-256 stream of the label read as little-endian 32-bit words, folded into
``[first_id, vocab_size)``. Ids below ``first_id`` are left out because small vocabularies
put their special tokens there (SmolLM2's ``<|im_start|>`` and friends sit in 0..16), and a
stray end-of-sequence id inside a prompt would change what an engine does with it.
"""

from __future__ import annotations

import hashlib

import numpy as np

SMOLLM2_VOCAB_SIZE = 49_152
FIRST_ORDINARY_ID = 256  # above every special token of the small models we serve


def pseudo_token_ids(label: bytes, count: int, vocab_size: int = SMOLLM2_VOCAB_SIZE,
                     first_id: int = FIRST_ORDINARY_ID) -> list[int]:
    """``count`` token ids drawn from ``label``; a shorter count gives a prefix of a longer one."""
    if count <= 0:
        return []
    if not 0 <= first_id < vocab_size:
        raise ValueError("need 0 <= first_id < vocab_size")
    words = np.frombuffer(hashlib.shake_256(label).digest(4 * count), dtype="<u4")
    return (words % (vocab_size - first_id) + first_id).tolist()
