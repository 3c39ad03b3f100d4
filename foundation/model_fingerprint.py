"""The model fingerprint: a short digest of what decides the KV a prompt leaves behind.

Two workers (and the orchestrator) must agree on it before any KV is shared between them;
it is part of every request's namespace (``foundation.identity``). It covers how text
becomes token ids (config and tokenizer files) and the weights themselves, so a fine-tune
that keeps its base model's config never exchanges KV with it:

- a model folder: its config and tokenizer files, and every weights file (safetensors,
  GGUF, PyTorch) by name, size and content hash, safetensors also by their header (every
  tensor's name, dtype and shape);
- a GGUF file: its size and content hash (it carries its own tokenizer);
- a hub id: the id and the revision the local Hugging Face cache resolves ``main`` to
  (the id alone, with a warning, when the model is not downloaded yet).

Hashing weights reads every byte once (~0.2 s for SmolLM2-135M's 270 MB), so content
hashes are kept per machine in ``file_hashes.json`` of kvroute's cache folder, keyed by
file identity (path, size, modification time, inode): a file is hashed again only when
it changed. Reading the fingerprint needs no torch or transformers, so the router can
compute it.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import struct
import tempfile
from pathlib import Path

from foundation.cache_dir import default_cache_dir

logger = logging.getLogger("kvroute.model_fingerprint")

# Files that decide how text becomes token ids; two workers must agree on all of them.
FINGERPRINT_FILES = ("config.json", "tokenizer.json", "tokenizer_config.json", "chat_template.jinja",
                     "special_tokens_map.json", "tokenizer.model", "vocab.json", "merges.txt")
WEIGHT_SUFFIXES = (".safetensors", ".gguf", ".bin", ".pt", ".pth")
# Keys that change with the writing library or location, not with the model itself.
VOLATILE_KEYS = frozenset({"transformers_version", "_name_or_path", "_model_name_or_path",
                           "is_local", "local_files_only"})
HASH_CACHE_NAME = "file_hashes.json"
SAFETENSORS_HEADER_LIMIT = 100 << 20  # the format's own limit on its JSON header


def _canonical(name: str, data: bytes) -> bytes:
    """JSON with volatile keys removed and keys sorted, so library upgrades keep the fingerprint."""
    if not name.endswith(".json"):
        return data
    obj = json.loads(data)
    if isinstance(obj, dict):
        obj = {k: v for k, v in obj.items() if k not in VOLATILE_KEYS}
    return json.dumps(obj, sort_keys=True).encode()


class FileHashes:
    """Content hashes of files, computed once per file identity and kept in ``cache_file``.

    ``computed`` counts the files this instance actually read. Several processes may start
    at once: each writes the whole file by atomic rename, so the worst a race costs is a
    file hashed again."""

    def __init__(self, cache_file: Path | None = None):
        if cache_file is None:
            cache_file = default_cache_dir() / HASH_CACHE_NAME
        self.cache_file = cache_file
        self.computed = 0

    def content_hash(self, path: Path) -> str:
        identity = _identity(path)
        known = self._load()
        if identity in known:
            return known[identity]
        with open(path, "rb") as file:
            digest = hashlib.file_digest(file, "sha256").hexdigest()
        self.computed += 1
        self._store({**known, identity: digest})
        return digest

    def _load(self) -> dict[str, str]:
        try:
            known = json.loads(self.cache_file.read_text())
            return known if isinstance(known, dict) else {}
        except (OSError, ValueError):
            return {}

    def _store(self, known: dict[str, str]) -> None:
        """Write ``known`` less the entries of files that changed or went away since."""
        current = {identity: digest for identity, digest in known.items() if _still_current(identity)}
        try:
            self.cache_file.parent.mkdir(parents=True, exist_ok=True)
            with tempfile.NamedTemporaryFile("w", dir=self.cache_file.parent, delete=False,
                                             prefix=f".{self.cache_file.name}.") as staging:
                json.dump(current, staging)
            os.replace(staging.name, self.cache_file)
        except OSError as error:  # a read-only home: hash again next time
            logger.warning("could not keep file hashes in %s (%s)", self.cache_file, error)


def _identity(path: Path) -> str:
    stat = path.stat()
    return json.dumps([str(path.resolve()), stat.st_size, stat.st_mtime_ns, stat.st_ino])


def _still_current(identity: str) -> bool:
    try:
        path = json.loads(identity)[0]
        return _identity(Path(path)) == identity
    except (OSError, ValueError, IndexError, TypeError):
        return False


def safetensors_header(path: Path) -> bytes:
    """Every tensor's name, dtype and shape, canonical JSON (offsets and metadata left out)."""
    with open(path, "rb") as file:
        (length,) = struct.unpack("<Q", file.read(8))
        if length > SAFETENSORS_HEADER_LIMIT:
            raise ValueError(f"{path}: safetensors header of {length} bytes")
        header = json.loads(file.read(length))
    tensors = {name: [info["dtype"], info["shape"]] for name, info in header.items() if name != "__metadata__"}
    return json.dumps(tensors, sort_keys=True).encode()


def _weights_entry(path: Path, hashes: FileHashes) -> bytes:
    entry = [path.stat().st_size, hashes.content_hash(path)]
    if path.suffix == ".safetensors":
        entry.append(safetensors_header(path).decode())
    return json.dumps(entry).encode()


def _folder_digest(folder: Path, hashes: FileHashes) -> str:
    digest = hashlib.blake2b(digest_size=8)
    for name in FINGERPRINT_FILES:
        if (folder / name).is_file():
            digest.update(name.encode() + b"\0" + _canonical(name, (folder / name).read_bytes()) + b"\0")
    for path in sorted(folder.iterdir()):
        if path.suffix in WEIGHT_SUFFIXES and path.is_file():
            digest.update(b"weights\0" + path.name.encode() + b"\0" + _weights_entry(path, hashes) + b"\0")
    return digest.hexdigest()


def hub_revision(repo_id: str, revision: str = "main") -> str | None:
    """The commit the local Hugging Face cache resolves ``revision`` of ``repo_id`` to, if any."""
    from huggingface_hub import constants

    refs = Path(constants.HF_HUB_CACHE) / f"models--{repo_id.replace('/', '--')}" / "refs" / revision
    try:
        return refs.read_text().strip() or None
    except OSError:
        return None


def _hub_digest(repo_id: str) -> str:
    commit = hub_revision(repo_id)
    if commit is None:
        logger.warning("%s is not in the local Hugging Face cache: its fingerprint covers the id only, not the "
                       "revision of its weights", repo_id)
        return hashlib.blake2b(b"id\0" + repo_id.encode(), digest_size=8).hexdigest()
    return hashlib.blake2b(b"id\0" + repo_id.encode() + b"\0revision\0" + commit.encode(), digest_size=8).hexdigest()


def model_fingerprint(path: str, hashes: FileHashes | None = None) -> str:
    """Short digest of a model folder, GGUF file or hub id (see the module's docstring),
    used to refuse workers serving another model."""
    target = Path(path).expanduser()
    hashes = hashes or FileHashes()
    if target.is_dir():
        return _folder_digest(target, hashes)
    if target.is_file():
        return hashlib.blake2b(b"file\0" + _weights_entry(target, hashes), digest_size=8).hexdigest()
    return _hub_digest(path)
