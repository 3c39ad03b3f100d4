"""The model fingerprint covers the weights: two models with the same config and tokenizer
but other weights differ, and a weights file is hashed once per file identity per machine."""

from __future__ import annotations

import json
import os
import struct

import pytest

from foundation import model_fingerprint as fingerprints
from foundation.model_fingerprint import FileHashes, model_fingerprint

CONFIG = {"model_type": "llama", "hidden_size": 64, "num_hidden_layers": 2}


def write_safetensors(path, payload: bytes, shape=(4, 4)) -> None:
    header = json.dumps({"w": {"dtype": "BF16", "shape": list(shape), "data_offsets": [0, len(payload)]},
                         "__metadata__": {"format": "pt"}}).encode()
    path.write_bytes(struct.pack("<Q", len(header)) + header + payload)


def make_model(folder, payload: bytes, shape=(4, 4)):
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps(CONFIG))
    (folder / "tokenizer.json").write_text('{"model": {"vocab": {"a": 0}}}')
    write_safetensors(folder / "model.safetensors", payload, shape)
    return folder


@pytest.fixture
def hashes(tmp_path):
    return FileHashes(tmp_path / "cache" / "file_hashes.json")


def test_same_config_other_weights_differ_and_same_weights_elsewhere_match(tmp_path, hashes):
    base = make_model(tmp_path / "base", bytes(32))
    fine_tune = make_model(tmp_path / "fine-tune", bytes(31) + b"\x01")
    copy = make_model(tmp_path / "copy", bytes(32))
    assert model_fingerprint(str(base), hashes) != model_fingerprint(str(fine_tune), hashes)
    assert model_fingerprint(str(base), hashes) == model_fingerprint(str(copy), hashes)


def test_a_reshaped_tensor_of_the_same_bytes_differs(tmp_path, hashes):
    square = make_model(tmp_path / "square", bytes(32), shape=(4, 4))
    flat = make_model(tmp_path / "flat", bytes(32), shape=(16,))
    assert model_fingerprint(str(square), hashes) != model_fingerprint(str(flat), hashes)


def test_a_file_is_hashed_once_per_identity_and_again_when_it_changes(tmp_path, hashes):
    model = make_model(tmp_path / "model", bytes(32))
    first = model_fingerprint(str(model), hashes)
    assert hashes.computed == 1

    again = FileHashes(hashes.cache_file)  # another process on this machine: the cache on disk
    assert model_fingerprint(str(model), again) == first
    assert again.computed == 0

    write_safetensors(model / "model.safetensors", b"\x02" * 32)
    stat = (model / "model.safetensors").stat()
    os.utime(model / "model.safetensors", ns=(stat.st_atime_ns, stat.st_mtime_ns + 1_000_000))
    assert model_fingerprint(str(model), again) != first
    assert again.computed == 1
    assert len(json.loads(hashes.cache_file.read_text())) == 1, "the changed file's old entry is pruned"


def test_a_gguf_file_by_its_content_wherever_it_lies(tmp_path, hashes):
    (tmp_path / "a").mkdir()
    (tmp_path / "b").mkdir()
    (tmp_path / "a" / "model.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "b" / "renamed.gguf").write_bytes(b"GGUF" + bytes(60))
    (tmp_path / "tuned.gguf").write_bytes(b"GGUF" + bytes(59) + b"\x01")
    a = model_fingerprint(str(tmp_path / "a" / "model.gguf"), hashes)
    assert a == model_fingerprint(str(tmp_path / "b" / "renamed.gguf"), hashes)
    assert a != model_fingerprint(str(tmp_path / "tuned.gguf"), hashes)


def test_hub_ids_by_the_revision_the_local_cache_resolves(tmp_path, hashes, monkeypatch):
    from huggingface_hub import constants

    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    unresolved = model_fingerprint("org/model", hashes)
    refs = tmp_path / "hub" / "models--org--model" / "refs"
    refs.mkdir(parents=True)
    (refs / "main").write_text("a" * 40)
    at_a = model_fingerprint("org/model", hashes)
    (refs / "main").write_text("b" * 40)
    at_b = model_fingerprint("org/model", hashes)
    assert len({unresolved, at_a, at_b}) == 3
    assert fingerprints.hub_revision("org/model") == "b" * 40
