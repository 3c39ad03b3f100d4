"""A prepared model's loadability verdict is remembered for its exact bytes and transformers
version, so the workers of a pool do not each spend seconds re-reading it."""

from __future__ import annotations

import hashlib
import json

import pytest

from foundation import model_prep
from foundation.model_prep import MANIFEST_NAME, ModelPreparationError, verify_model


@pytest.fixture
def folder(tmp_path):
    path = tmp_path / "models" / "tiny"
    path.mkdir(parents=True)
    (path / "config.json").write_text("{}")
    files = {"config.json": hashlib.sha256(b"{}").hexdigest()}
    (path / MANIFEST_NAME).write_text(json.dumps({"version": model_prep.MANIFEST_VERSION, "files": files}))
    return path


@pytest.fixture
def loads(monkeypatch):
    checked = []
    monkeypatch.setattr(model_prep, "_check_usable", checked.append)
    return checked


def test_a_verdict_is_reused_for_the_same_bytes_and_library(folder, loads):
    verify_model(folder)
    verify_model(folder)
    assert loads == [folder]


def test_another_transformers_version_checks_again(folder, loads, monkeypatch):
    verify_model(folder)
    monkeypatch.setattr(model_prep.importlib.metadata, "version", lambda name: "0.0-other")
    verify_model(folder)
    assert loads == [folder, folder]


def test_a_resealed_folder_checks_again(folder, loads):
    verify_model(folder)
    manifest = json.loads((folder / MANIFEST_NAME).read_text())
    (folder / MANIFEST_NAME).write_text(json.dumps({**manifest, "model": "rebuilt"}))
    verify_model(folder)
    assert loads == [folder, folder]


def test_hashes_are_checked_even_with_a_verdict(folder, loads):
    verify_model(folder)
    (folder / "config.json").write_text('{"edited": true}')
    with pytest.raises(ModelPreparationError, match="does not match its recorded sha256"):
        verify_model(folder)


def test_a_folder_about_to_be_renamed_leaves_no_verdict(folder, loads):
    verify_model(folder, remember=False)
    assert [p.name for p in folder.parent.iterdir()] == ["tiny"]


def test_an_unwritable_cache_still_verifies(folder, loads, monkeypatch):
    def refuse(self, text):
        raise PermissionError("read-only cache")
    monkeypatch.setattr(model_prep.Path, "write_text", refuse)
    verify_model(folder)
    verify_model(folder)
    assert loads == [folder, folder]
