"""Configuration is data: flags, environment variables and a config file map onto one
frozen settings dataclass, in one place.

Precedence, lowest first: the dataclass defaults, the config file (YAML or JSON, keys
are field names), environment variables ``KVROUTE_<FIELD>``, then command-line flags
that were given explicitly. Every field becomes a ``--flag`` whose help text comes from
the field's ``metadata["help"]``.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import types
import typing
from pathlib import Path
from typing import Any, TypeVar

import yaml

T = TypeVar("T")
ENV_PREFIX = "KVROUTE_"


class ConfigError(ValueError):
    pass


def setting(default: Any, help: str, **kwargs: Any) -> Any:
    """A dataclass field with its help text, for ``add_arguments``."""
    return dataclasses.field(default=default, metadata={"help": help, **kwargs})


def add_arguments(parser: argparse.ArgumentParser, cls: type, with_config_flag: bool = True) -> None:
    """One ``--flag`` per field; flags default to None so only explicit ones override."""
    if with_config_flag:
        parser.add_argument("--config", type=Path, default=None,
                            help="YAML or JSON file with settings (keys are the flag names with underscores)")
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        if not field.metadata.get("help"):
            continue
        flag = "--" + field.name.replace("_", "-")
        kind = _base_type(hints[field.name])
        help_text = f"{field.metadata['help']} (default: {field.default!r}; env {ENV_PREFIX}{field.name.upper()})"
        if kind is bool:
            parser.add_argument(flag, action=argparse.BooleanOptionalAction, default=None, help=help_text)
        else:
            parser.add_argument(flag, type=kind if kind in (int, float) else _split if kind is tuple else str,
                                default=None, help=help_text)


def load(cls: type[T], args: argparse.Namespace | None = None, environ: dict[str, str] | None = None,
         only_known: bool = False) -> T:
    """Build ``cls`` from defaults ← config file ← environment ← explicit flags.

    ``only_known`` takes from the config file just the keys ``cls`` has, for commands
    whose one file configures several settings objects.
    """
    environ = os.environ if environ is None else environ
    values: dict[str, Any] = {}
    config_path = getattr(args, "config", None) if args is not None else None
    names = {f.name for f in dataclasses.fields(cls)}
    if config_path is not None:
        values.update({k: v for k, v in read_config_file(config_path).items() if not only_known or k in names})
    hints = typing.get_type_hints(cls)
    for name in names:
        raw = environ.get(ENV_PREFIX + name.upper())
        if raw is not None:
            values[name] = _parse(raw, hints[name], name)
        flag_value = getattr(args, name, None) if args is not None else None
        if flag_value is not None:
            values[name] = flag_value
    unknown = set(values) - names
    if unknown:
        raise ConfigError(f"unknown settings: {sorted(unknown)}")
    try:
        return cls(**values)
    except (TypeError, ValueError) as error:
        raise ConfigError(str(error)) from error


def read_config_file(path: Path) -> dict[str, Any]:
    try:
        text = Path(path).read_text()
    except OSError as error:
        raise ConfigError(f"cannot read config file {path}: {error}") from error
    try:
        data = json.loads(text) if str(path).endswith(".json") else yaml.safe_load(text)
    except (ValueError, yaml.YAMLError) as error:
        raise ConfigError(f"cannot parse config file {path}: {error}") from error
    if not isinstance(data, dict):
        raise ConfigError(f"config file {path} must hold a mapping of setting names to values")
    return {key.replace("-", "_"): value for key, value in data.items()}


def _base_type(hint: Any) -> type:
    """``int | None`` → int; ``tuple[str, ...]`` → tuple; plain types unchanged."""
    if isinstance(hint, types.UnionType) or typing.get_origin(hint) is typing.Union:
        inner = [arg for arg in typing.get_args(hint) if arg is not type(None)]
        return _base_type(inner[0])
    return typing.get_origin(hint) or hint


def _split(raw: str) -> tuple[str, ...]:
    """A comma-separated list, as environment variables and flags spell tuples."""
    return tuple(item for item in raw.split(",") if item)


def _parse(raw: str, hint: Any, name: str) -> Any:
    kind = _base_type(hint)
    try:
        if kind is bool:
            return raw.strip().lower() in ("1", "true", "yes", "on")
        if kind in (int, float):
            return kind(raw)
        if kind is tuple:
            return _split(raw)
        return raw
    except ValueError as error:
        raise ConfigError(f"{ENV_PREFIX}{name.upper()}={raw!r}: {error}") from error
