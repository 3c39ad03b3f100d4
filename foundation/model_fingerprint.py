"""The model fingerprint: a short digest of what decides how text becomes token ids.

Two workers (and the orchestrator) must agree on it before any KV is shared between them;
it is part of every request's namespace (``foundation.identity``). Reading it needs no
torch or transformers, so the router can compute it.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

# Files that decide how text becomes token ids; two workers must agree on all of them.
FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")
# Keys that change with the writing library or location, not with the model itself.
VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "_model_name_or_path",
                           "is_local", "local_files_only"})


def _canonical(name: str, data: bytes) -> bytes:
    """JSON with volatile keys removed and keys sorted, so library upgrades keep the fingerprint."""
    if not name.endswith(".json"):
        return data
    obj = json.loads(data)
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in VOLATILE_KEYS}
    return json.dumps(obj, sort_keys=True).encode()


def model_fingerprint(path: str) -> str:
    """Short digest of config + tokenizer files (or of a hub id) used to refuse mismatched workers."""
    folder = Path(path).expanduser()
    if not folder.is_dir():
        return hashlib.blake2b(b"id\0" + path.encode(), digest_size=8).hexdigest()
    digest = hashlib.blake2b(digest_size=8)
    for name in FINGERPRINT_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + _canonical(name, (folder / name).read_bytes()) + b"\0")
    return digest.hexdigest()
