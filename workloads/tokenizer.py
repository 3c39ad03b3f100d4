"""Token counts with the model's own tokenizer, for generators and measurements that want exact
lengths (the generators default to ``approx_tokens`` and need nothing of the model)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

from workloads.base import TokenCounter


def _default_model_dir() -> Path:
    # Prepared on first use (cached afterwards), so a benchmark runs on a fresh machine too.
    from foundation.model_prep import prepare_model
    return prepare_model(progress=False)


def load_tokenizer(model: str | Path | None = None):
    """The model's Hugging Face tokenizer (default: the prepared SmolLM2 folder). Needs transformers."""
    from transformers import AutoTokenizer
    return AutoTokenizer.from_pretrained(str(model or _default_model_dir()))


def tokenizer_counter(tokenizer) -> TokenCounter:
    """A ``count_tokens`` for the generators: plain text tokens, no special tokens."""
    return lambda text: len(tokenizer(text, add_special_tokens=False)["input_ids"])


def prompt_tokens(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> int:
    """Tokens of ``messages`` after the chat template, as the orchestrator will count them."""
    encoded = tokenizer.apply_chat_template(messages, add_generation_prompt=add_generation_prompt, tokenize=True)
    return len(encoded["input_ids"] if hasattr(encoded, "keys") else encoded)


def estimate_prefix_tokens(prefixes: Sequence[str], tokenizer=None) -> list[int]:
    """Tokens of each prefix as a templated system turn: the part requests for the same
    repository share. With ``tokenizer=None`` the model's tokenizer is loaded."""
    tokenizer = tokenizer or load_tokenizer()
    return [prompt_tokens(tokenizer, [{"role": "system", "content": p}], add_generation_prompt=False)
            for p in prefixes]
