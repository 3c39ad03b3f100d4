"""A model's tokenizer files and chat template, read without transformers.

The router tokenizes every request, but loading a tokenizer through transformers imports
torch (its configuration classes do), which costs the CPU-only router seconds of start-up
and hundreds of MB for nothing. The fast tokenizer (``tokenizer.json``) is the
``tokenizers`` library's own format, and the chat template is Jinja rendered the way
transformers renders it: a sandboxed environment with ``trim_blocks``/``lstrip_blocks``,
loop controls, a ``tojson`` that does not escape HTML, ``raise_exception`` and
``strftime_now``, and the special tokens as variables.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from datetime import datetime
from functools import cached_property
from pathlib import Path

import jinja2
import jinja2.ext
from jinja2.sandbox import ImmutableSandboxedEnvironment
from tokenizers import Tokenizer

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "chat_template.jinja", "chat_template.json",
                   "special_tokens_map.json")
SPECIAL_TOKEN_KEYS = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")


class TokenizerFilesError(RuntimeError):
    """The model's tokenizer files are missing or not in a form the router reads."""


def tokenizer_folder(model: str) -> Path:
    """The folder holding ``model``'s tokenizer files: the model folder itself, or for a hub
    id the tokenizer files alone, fetched once into the Hugging Face cache."""
    folder = Path(model).expanduser()
    if folder.is_dir():
        return folder
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(model, allow_patterns=list(TOKENIZER_FILES)))


def _raise_exception(message: str):
    raise jinja2.exceptions.TemplateError(message)


def _tojson(value, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(value, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_template(source: str) -> jinja2.Template:
    environment = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                                extensions=[jinja2.ext.loopcontrols])
    environment.filters["tojson"] = _tojson
    environment.globals["raise_exception"] = _raise_exception
    environment.globals["strftime_now"] = lambda fmt: datetime.now().strftime(fmt)
    return environment.from_string(source)


def _token_text(value) -> str | None:
    """A special token as tokenizer_config.json writes it: a string or ``{"content": ...}``."""
    if isinstance(value, dict):
        return value.get("content")
    return value if isinstance(value, str) else None


@dataclass(frozen=True)
class TokenizerFiles:
    """One model's ``tokenizer.json``, its special tokens and its chat template."""

    folder: Path

    @classmethod
    def of(cls, model: str) -> TokenizerFiles:
        folder = tokenizer_folder(model)
        if not (folder / "tokenizer.json").is_file():
            raise TokenizerFilesError(f"{folder} has no tokenizer.json; the router reads fast tokenizers only")
        return cls(folder)

    def _json(self, name: str) -> dict:
        path = self.folder / name
        return json.loads(path.read_text()) if path.is_file() else {}

    @cached_property
    def config(self) -> dict:
        return self._json("tokenizer_config.json")

    def tokenizer(self) -> Tokenizer:
        return Tokenizer.from_file(str(self.folder / "tokenizer.json"))

    @cached_property
    def special_tokens(self) -> dict[str, str]:
        """``bos_token`` and the like, by name, as the chat template sees them."""
        found = {**self._json("special_tokens_map.json"), **self.config}
        tokens = {key: _token_text(found.get(key)) for key in SPECIAL_TOKEN_KEYS}
        return {key: text for key, text in tokens.items() if text is not None}

    def chat_template(self) -> str:
        jinja = self.folder / "chat_template.jinja"
        if jinja.is_file():
            return jinja.read_text()
        template = self._json("chat_template.json").get("chat_template") or self.config.get("chat_template")
        if isinstance(template, list):  # named templates: the default one
            template = next((t["template"] for t in template if t.get("name") == "default"), None)
        if not isinstance(template, str):
            raise TokenizerFilesError(f"{self.folder} has no chat template")
        return template
