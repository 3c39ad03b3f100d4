"""Distinct prompts for ``kvroute bench disagg``: no two share even their first KV block."""

from __future__ import annotations

import random
import uuid

# Plain English words; prompts are random sequences of them behind a random nonce,
# so no two prompts share even their first KV block.
WORDS = """time person year way day thing man world life hand part child eye woman place work week
case point government company number group problem fact be have do say get make go know take see
come think look want give use find tell ask work seem feel try leave call good new first last long
great little own other old right big high different small large next early young important few
public bad same able river mountain garden window engine signal market letter bridge forest
harbor lantern silver copper orange violet thunder whisper candle meadow valley planet rocket
ocean island desert castle village station library museum kitchen theater circuit pattern""".split()


class Prompts:
    """Distinct prompts: a random nonce first, random words after."""

    def __init__(self, tokenizer, seed: int = 1234):
        self.tokenizer = tokenizer
        self.rng = random.Random(seed)

    def _words(self, num_tokens: int) -> list[int]:
        text = " ".join(self.rng.choice(WORDS) for _ in range(num_tokens))  # >= 1 token per word
        ids = self.tokenizer.encode(text, add_special_tokens=False)
        assert len(ids) >= num_tokens
        return ids[:num_tokens]

    def chat(self, approx_tokens: int) -> list[int]:
        """A chat-formatted prompt of about ``approx_tokens`` tokens."""
        nonce = uuid.uuid4().hex
        body = self.tokenizer.decode(self._words(max(approx_tokens - 60, 1)))
        messages = [{"role": "system", "content": f"Session {nonce}. You are a careful reader."},
                    {"role": "user", "content": f"{body}\n\nSummarize the text above in one sentence."}]
        encoded = self.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
        ids = encoded["input_ids"] if hasattr(encoded, "keys") else encoded
        return list(ids)

    def exact(self, num_tokens: int) -> list[int]:
        """Exactly ``num_tokens`` plain-text tokens (to fill whole KV blocks)."""
        head = self.tokenizer.encode(f"Session {uuid.uuid4().hex}.", add_special_tokens=False)
        return (head + self._words(num_tokens))[:num_tokens]
