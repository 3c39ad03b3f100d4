"""Seeded workload generators for placement benchmarks (not part of the serving path).

Each generator is a frozen config dataclass with documented defaults and a function
``generate_*(config, count_tokens=None) -> list[WorkloadRequest]`` (chat messages, an
arrival time, ``max_tokens``), deterministic under the config's seed. The module of each
says the shape and what it stresses:

* ``repository-assistant``: ``RepositoryAssistantConfig``, ``generate_workload`` (``repository_assistant``)
* ``support-chat``: ``SupportChatConfig``, ``generate_support_chat`` (``support_chat``)
* ``rag``: ``RagConfig``, ``generate_rag`` (``rag``)
* ``batch``: ``BatchConfig``, ``generate_batch`` (``batch``)
* ``generated-shared-prefix``: ``GeneratedSharedPrefixConfig``, ``generate_shared_prefix`` (``shared_prefix``)
* ``prefix-repetition``: ``PrefixRepetitionConfig``, ``generate_prefix_repetition`` (``prefix_repetition``)
* ``no-sharing``: ``NoSharingConfig``, ``generate_no_sharing`` (``no_sharing``)

``registry.GENERATORS`` maps the names onto them. Lengths are in tokens of the model's
tokenizer when a ``count_tokens`` callable is given (``tokenizer_counter``), else
estimated with ``approx_tokens``, a characters-per-token ratio measured for this
pseudo-text with SmolLM2's tokenizer; a text fitted to a length has it or a token or two
fewer. The text is made-up words drawn from per-purpose seeded streams (``base``,
``pseudotext``), so prompts share exactly the parts their workload says they share.
"""

from workloads.base import LETTERS_PER_TOKEN, TokenCounter, WorkloadRequest, approx_tokens, zipf_weights
from workloads.batch import BatchConfig, generate_batch
from workloads.no_sharing import NoSharingConfig, generate_no_sharing
from workloads.prefix_repetition import PrefixRepetitionConfig, generate_prefix_repetition
from workloads.rag import RagConfig, generate_rag
from workloads.registry import GENERATORS, generate_named, parse_options, workload_config
from workloads.repository_assistant import (
                                          RepositoryAssistantConfig,
                                          generate_workload,
                                          prefix_target_tokens,
                                          repository_prefix,
                                          repository_prefixes,
)
from workloads.shared_prefix import GeneratedSharedPrefixConfig, generate_shared_prefix
from workloads.support_chat import SupportChatConfig, generate_support_chat
from workloads.tokenizer import estimate_prefix_tokens, load_tokenizer, prompt_tokens, tokenizer_counter

__all__ = [
    "LETTERS_PER_TOKEN", "TokenCounter", "WorkloadRequest", "approx_tokens", "zipf_weights",
    "GENERATORS", "generate_named", "parse_options", "workload_config",
    "RepositoryAssistantConfig", "generate_workload", "prefix_target_tokens", "repository_prefix",
    "repository_prefixes",
    "SupportChatConfig", "generate_support_chat",
    "RagConfig", "generate_rag",
    "BatchConfig", "generate_batch",
    "GeneratedSharedPrefixConfig", "generate_shared_prefix",
    "PrefixRepetitionConfig", "generate_prefix_repetition",
    "NoSharingConfig", "generate_no_sharing",
    "estimate_prefix_tokens", "load_tokenizer", "prompt_tokens", "tokenizer_counter",
]
