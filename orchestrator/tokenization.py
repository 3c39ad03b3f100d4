"""Text ↔ token ids in the orchestrator: the model's tokenizer and chat template.

Placement needs token ids before any worker sees the request, and the merged
prefill + decode token stream is detokenized here, where stop strings are applied.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from tokenizers.decoders import DecodeStream

from orchestrator.chat_template import TokenizerFiles, compile_template


class PromptError(ValueError):
    """A prompt that cannot be turned into token ids (the client's fault)."""


class TextCodec:
    """The model's fast tokenizer and chat template (``orchestrator.chat_template``): the
    same token ids transformers' tokenizer gives, without importing torch."""

    def __init__(self, model_path: str):
        files = TokenizerFiles.of(model_path)
        self.tokenizer = files.tokenizer()
        self.special_tokens = files.special_tokens
        self.template = compile_template(files.chat_template())
        self.vocab_size = self.tokenizer.get_vocab_size(with_added_tokens=True)
        eos = self.special_tokens.get("eos_token")
        self.eos_token_id = self.tokenizer.token_to_id(eos) if eos else None

    def encode_chat(self, messages: list[dict]) -> list[int]:
        if not messages:
            raise PromptError("cannot apply the chat template to an empty conversation")
        try:
            text = self.template.render(messages=messages, tools=None, documents=None, add_generation_prompt=True,
                                        **self.special_tokens)
        except Exception as error:  # template errors are caused by the messages given
            raise PromptError(f"cannot apply the chat template: {error}") from error
        # The template writes the special tokens itself.
        return self.tokenizer.encode(text, add_special_tokens=False).ids

    def encode_text(self, text: str) -> list[int]:
        return self.tokenizer.encode(text).ids

    def check_token_ids(self, token_ids: list[int]) -> None:
        bad = [t for t in token_ids if not 0 <= t < self.vocab_size]
        if bad:
            raise PromptError(f"token ids outside the vocabulary (0..{self.vocab_size - 1}): {bad[:5]}")

    def text_stream(self, stop: list[str]) -> TextStream:
        return TextStream(self.tokenizer, stop)


@dataclass
class TextStream:
    """Incremental detokenization with stop strings, one instance per completion.

    Text that could still become the start of a stop string is held back, so a client
    never sees part of a stop string. ``stopped`` turns true when one matched; the
    text up to (not including) it has then been released.
    """

    backend: object
    stop: list[str]
    text: str = ""
    released: int = 0
    stopped: bool = False
    _decoder: DecodeStream = field(default_factory=lambda: DecodeStream(skip_special_tokens=True))

    def push(self, token_ids: list[int]) -> str:
        """Feed tokens; return the newly releasable text."""
        for token in token_ids:
            if self.stopped:
                break
            piece = self._decoder.step(self.backend, token)
            if piece:
                self.text += piece
                self._check_stop(len(piece))
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """Release whatever was held back once the completion is over."""
        return self._release(final=True)

    def _check_stop(self, new_chars: int) -> None:
        window_start = max(0, len(self.text) - new_chars - max((len(s) for s in self.stop), default=0))
        hits = [i for s in self.stop if (i := self.text.find(s, window_start)) != -1]
        if hits:
            self.text = self.text[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.text) if final else len(self.text) - self._held_back()
        end = max(end, self.released)
        chunk, self.released = self.text[self.released:end], end
        return chunk

    def _held_back(self) -> int:
        """Length of the longest text suffix that is a proper prefix of a stop string."""
        longest = 0
        for stop in self.stop:
            for size in range(min(len(stop) - 1, len(self.text)), longest, -1):
                if self.text.endswith(stop[:size]):
                    longest = size
                    break
        return longest
