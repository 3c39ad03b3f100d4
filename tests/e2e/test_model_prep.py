"""Tests for foundation.model_prep: GGUF -> bf16 Hugging Face folder, caching, verification."""

from __future__ import annotations

import argparse
import json
import shutil
import time
from pathlib import Path

import pytest

pytest.importorskip("transformers")
pytest.importorskip("safetensors")

from foundation import model_prep  # noqa: E402
from foundation.model_fingerprint import model_fingerprint  # noqa: E402
from foundation.model_prep import (  # noqa: E402
    DEFAULT_MODEL_NAME,
    MANIFEST_NAME,
    ModelPreparationError,
    prepare_model,
    resolve_model,
    verify_model,
)

try:
    model_prep.locate_gguf()
except ModelPreparationError as exc:  # pragma: no cover - depends on the environment
    pytest.skip(str(exc), allow_module_level=True)


@pytest.fixture(scope="session")
def cache_dir(tmp_path_factory) -> Path:
    return tmp_path_factory.mktemp("kvroute-cache")


@pytest.fixture(scope="session")
def prepared(cache_dir) -> Path:
    """One real conversion shared by the whole session (it takes ~20 s on CPU)."""
    return prepare_model(cache_dir, progress=False)


@pytest.fixture
def copy_of(tmp_path, prepared):
    """A private copy in its own cache dir, for tests that damage or rebuild the model."""
    cache = tmp_path / "cache"
    dest = cache / "models" / DEFAULT_MODEL_NAME
    shutil.copytree(prepared, dest)
    return cache, dest


def _mtimes(folder: Path) -> dict[str, int]:
    return {p.name: p.stat().st_mtime_ns for p in folder.iterdir()}


def test_default_cache_dir_follows_env(monkeypatch, tmp_path):
    monkeypatch.setenv("KVROUTE_CACHE_DIR", str(tmp_path))
    assert model_prep.default_cache_dir() == tmp_path
    assert model_prep.model_dir() == tmp_path / "models" / DEFAULT_MODEL_NAME
    monkeypatch.delenv("KVROUTE_CACHE_DIR")
    assert model_prep.default_cache_dir() == Path.home() / ".cache" / "kvroute"


def test_folder_layout(prepared, cache_dir):
    assert prepared == cache_dir / "models" / DEFAULT_MODEL_NAME
    for name in ("model.safetensors", "config.json", "tokenizer.json", "tokenizer_config.json", MANIFEST_NAME):
        assert (prepared / name).is_file(), name
    config = json.loads((prepared / "config.json").read_text())
    assert "quantization_config" not in config
    assert config["architectures"] == ["LlamaForCausalLM"]
    manifest = json.loads((prepared / MANIFEST_NAME).read_text())
    assert manifest["source"]["file"] == model_prep.GGUF_FILE
    assert manifest["source"]["size"] == model_prep.locate_gguf().stat().st_size
    assert len(manifest["source"]["sha256"]) == 64
    assert set(manifest["files"]) == {p.name for p in prepared.iterdir()} - {MANIFEST_NAME}
    assert not [p for p in prepared.parent.iterdir() if ".tmp-" in p.name or ".old-" in p.name]


def test_tensors_are_bf16(prepared):
    from safetensors import safe_open

    with safe_open(prepared / "model.safetensors", framework="pt") as f:
        keys = list(f.keys())
        dtypes = {f.get_slice(k).get_dtype() for k in keys}
    assert dtypes == {"BF16"}
    assert "model.embed_tokens.weight" in keys
    assert len(keys) > 200


def test_chat_template_applies_after_reload(prepared):
    from transformers import AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(prepared)
    text = tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is the capital of France?"}], tokenize=False, add_generation_prompt=True
    )
    assert "What is the capital of France?" in text
    assert text.endswith("<|im_start|>assistant\n")
    assert len(tokenizer) == 49152


def test_verify_accepts_prepared(prepared):
    verify_model(prepared)


def test_second_call_is_cached(prepared, cache_dir, monkeypatch):
    before = _mtimes(prepared)

    def no_rebuild(*args, **kwargs):
        raise AssertionError("a verified cached model must not be rebuilt")

    monkeypatch.setattr(model_prep, "_build", no_rebuild)
    start = time.monotonic()
    assert prepare_model(cache_dir, progress=False) == prepared
    assert time.monotonic() - start < 15
    assert _mtimes(prepared) == before


def test_verify_rejects_corrupted_weights(copy_of):
    _, folder = copy_of
    with open(folder / "model.safetensors", "r+b") as fh:
        fh.seek(10_000_000)
        byte = fh.read(1)
        fh.seek(10_000_000)
        fh.write(bytes([byte[0] ^ 0xFF]))
    with pytest.raises(ModelPreparationError, match="model.safetensors"):
        verify_model(folder)


@pytest.mark.parametrize("victim", ["tokenizer.json", "config.json", MANIFEST_NAME])
def test_verify_rejects_missing_files(copy_of, victim):
    _, folder = copy_of
    (folder / victim).unlink()
    with pytest.raises(ModelPreparationError):
        verify_model(folder)


def test_verify_rejects_missing_folder(tmp_path):
    with pytest.raises(ModelPreparationError, match="no such model folder"):
        verify_model(tmp_path / "nothing-here")


def test_corrupted_model_is_rebuilt(copy_of, prepared):
    cache, folder = copy_of
    (folder / "config.json").write_text("{}")
    with pytest.raises(ModelPreparationError):
        verify_model(folder)
    assert prepare_model(cache, progress=False) == folder
    verify_model(folder)
    assert (folder / "config.json").read_bytes() == (prepared / "config.json").read_bytes()
    assert not [p for p in folder.parent.iterdir() if p.name.startswith(".") and p.is_dir()]


def test_failed_build_leaves_nothing_behind(tmp_path, monkeypatch):
    def half_write(folder, *args):
        (folder / "model.safetensors").write_bytes(b"partial")
        raise OSError("disk full")

    monkeypatch.setattr(model_prep, "_load_from_gguf", lambda gguf: (None, None))
    monkeypatch.setattr(model_prep, "_make_plain", lambda model, tokenizer: None)
    monkeypatch.setattr(model_prep, "_write_folder", half_write)
    with pytest.raises(OSError, match="disk full"):
        prepare_model(tmp_path, progress=False)
    models = tmp_path / "models"
    assert [p.name for p in models.iterdir() if p.is_dir()] == []


def test_resolve_model(prepared, cache_dir, tmp_path, monkeypatch):
    assert resolve_model(None, cache_dir) == str(prepared)
    assert resolve_model(DEFAULT_MODEL_NAME, cache_dir) == str(prepared)
    (tmp_path / "local-model").mkdir()
    monkeypatch.chdir(tmp_path)
    resolved = resolve_model("local-model", cache_dir)
    assert Path(resolved).is_absolute() and resolved == str(tmp_path.resolve() / "local-model")
    assert resolve_model("HuggingFaceTB/SmolLM2-135M-Instruct", cache_dir) == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert resolve_model("./does-not-exist", cache_dir) == "./does-not-exist"


def test_fingerprint_stable_and_discriminating(prepared, copy_of, tmp_path):
    _, copy = copy_of
    fp = model_fingerprint(str(prepared))
    assert fp == model_fingerprint(str(prepared))
    assert fp == model_fingerprint(str(copy)), "same files in another place must match"
    int(fp, 16)

    config = json.loads((copy / "config.json").read_text())
    config["transformers_version"] = "0.0.1"  # library bookkeeping, not a model change
    (copy / "config.json").write_text(json.dumps(config, indent=4))
    assert model_fingerprint(str(copy)) == fp

    config["vocab_size"] += 1
    (copy / "config.json").write_text(json.dumps(config))
    assert model_fingerprint(str(copy)) != fp

    other = tmp_path / "other"
    other.mkdir()
    (other / "config.json").write_text('{"model_type": "llama", "hidden_size": 64}')
    assert model_fingerprint(str(other)) not in (fp, model_fingerprint(str(copy)))


def test_fingerprint_of_hub_ids():
    a = model_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert a == model_fingerprint("HuggingFaceTB/SmolLM2-135M-Instruct")
    assert a != model_fingerprint("HuggingFaceTB/SmolLM2-360M-Instruct")


def test_cli_prepare_prints_path(prepared, cache_dir, capsys):
    parser = argparse.ArgumentParser(prog="kvroute")
    model_prep.add_cli(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["model", "prepare", "--cache-dir", str(cache_dir), "--no-progress"])
    assert args.force is False
    assert args.func(args) == 0
    assert capsys.readouterr().out.strip() == str(prepared)
    with pytest.raises(SystemExit):
        parser.parse_args(["model"])
