"""Workload generators by name, and building one from overrides given as strings.

``GENERATORS`` is what ``kvroute bench replay --workload`` and ``kvroute bench simulate
--workload`` offer. Overrides name fields of the generator's config (``groups=8``); a
value is parsed as the type of the field's default. ``requests`` is a field of some
configs; for the others (whose size is structural: conversations, groups x prompts) it
keeps the first N requests in arrival order, so it never makes a workload bigger.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass

from workloads.base import TokenCounter, WorkloadRequest
from workloads.batch import BatchConfig, generate_batch
from workloads.no_sharing import NoSharingConfig, generate_no_sharing
from workloads.prefix_repetition import PrefixRepetitionConfig, generate_prefix_repetition
from workloads.rag import RagConfig, generate_rag
from workloads.repository_assistant import RepositoryAssistantConfig, generate_workload
from workloads.shared_prefix import GeneratedSharedPrefixConfig, generate_shared_prefix
from workloads.support_chat import SupportChatConfig, generate_support_chat


@dataclass(frozen=True)
class Generator:
    config_type: type
    generate: Callable[..., list[WorkloadRequest]]  # (config, count_tokens=None) -> requests
    summary: str  # one line, for help texts


GENERATORS: dict[str, Generator] = {
    "repository-assistant": Generator(RepositoryAssistantConfig, generate_workload,
                                      "long shared repository prefixes, short questions (Zipf popularity)"),
    "support-chat": Generator(SupportChatConfig, generate_support_chat,
                              "multi-turn conversations whose history grows turn by turn"),
    "rag": Generator(RagConfig, generate_rag,
                     "per-tenant instruction prefix + passages from a shared corpus + question"),
    "batch": Generator(BatchConfig, generate_batch,
                       "independent long prompts all at once, one short common instruction"),
    "generated-shared-prefix": Generator(GeneratedSharedPrefixConfig, generate_shared_prefix,
                                         "SGLang's shape: G groups x P prompts, S-token system prompt, Q, O"),
    "prefix-repetition": Generator(PrefixRepetitionConfig, generate_prefix_repetition,
                                   "vLLM's shape: prefixes x repetitions, prefix and suffix lengths, output"),
    "no-sharing": Generator(NoSharingConfig, generate_no_sharing,
                            "negative control: every prompt unique from its first token"),
}


def parse_options(options: Sequence[str]) -> dict[str, str]:
    """``["groups=8", "rate=2"]`` → ``{"groups": "8", "rate": "2"}``."""
    pairs = {}
    for option in options:
        key, sep, value = option.partition("=")
        if not sep or not key.strip():
            raise ValueError(f"workload option {option!r} is not KEY=VALUE")
        pairs[key.strip().replace("-", "_")] = value.strip()
    return pairs


def workload_config(name: str, overrides: Mapping[str, object]):
    """The config of workload ``name``: its defaults with ``overrides`` (strings are parsed)."""
    generator = _generator(name)
    fields = {field.name: field for field in dataclasses.fields(generator.config_type)}
    unknown = sorted(set(overrides) - set(fields))
    if unknown:
        raise ValueError(f"workload {name!r} has no option {', '.join(unknown)}; it has {', '.join(fields)}")
    values = {key: _parsed(value, fields[key].default, key) for key, value in overrides.items()}
    return generator.config_type(**values)


def generate_named(name: str, overrides: Mapping[str, object] | None = None, *, requests: int | None = None,
                   rate: float | None = None, seed: int | None = None,
                   count_tokens: TokenCounter | None = None) -> list[WorkloadRequest]:
    """Workload ``name``'s requests. ``requests``, ``rate`` and ``seed`` set the config's
    fields of those names where it has them (over ``overrides`` of the same); a ``requests``
    that is no field keeps the first N requests, a ``rate`` that is none is ignored (batch
    arrives at once)."""
    generator = _generator(name)
    fields = {field.name for field in dataclasses.fields(generator.config_type)}
    common = {key: value for key, value in {"requests": requests, "rate": rate, "seed": seed}.items()
              if value is not None and key in fields}
    workload = generator.generate(workload_config(name, {**(overrides or {}), **common}), count_tokens)
    return workload[:requests] if requests is not None and "requests" not in fields else workload


def _generator(name: str) -> Generator:
    if name not in GENERATORS:
        raise ValueError(f"unknown workload {name!r}; choose one of {', '.join(GENERATORS)}")
    return GENERATORS[name]


def _parsed(value: object, default: object, key: str) -> object:
    if not isinstance(value, str) or isinstance(default, str):
        return value
    try:
        return type(default)(value)  # every config field is an int or a float ("inf" parses)
    except ValueError:
        kind = "an integer" if isinstance(default, int) else "a number"
        raise ValueError(f"workload option {key}={value!r}: expected {kind}") from None
