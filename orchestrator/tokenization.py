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
        return self._ids(text, add_special_tokens=False)

    def encode_text(self, text: str) -> list[int]:
        return self._ids(text, add_special_tokens=True)

    def _ids(self, text: str, add_special_tokens: bool) -> list[int]:
        # encode_batch releases the GIL while it runs and encode does not, so a large prompt
        # tokenized on a worker thread (orchestrator.api) leaves the event loop free to stream
        # (a 1 M-character prompt: a 12 ms stall instead of the whole second); ~5 µs more a prompt.
        return self.tokenizer.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids

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

    Only the text not yet released is kept (``pending``): a stop string cannot start in
    released text, since released text never ends with a possible start of one. So each
    push costs time in proportion to its new text plus the longest stop string (times the
    number of stops), however long the output already is.
    """

    backend: object
    stop: list[str]
    pending: str = ""
    stopped: bool = False
    _decoder: DecodeStream = field(default_factory=lambda: DecodeStream(skip_special_tokens=True))

    def __post_init__(self):
        self._longest_stop = max(map(len, self.stop), default=0)

    def push(self, token_ids: list[int]) -> str:
        """Feed tokens; return the newly releasable text."""
        for token in token_ids:
            if self.stopped:
                break
            piece = self._decoder.step(self.backend, token)
            if piece:
                self.pending += piece
                self._check_stop(len(piece))
        return self._release(final=self.stopped)

    def finish(self) -> str:
        """Release whatever was held back once the completion is over."""
        return self._release(final=True)

    def _check_stop(self, new_chars: int) -> None:
        # A stop completed by this piece ends inside it, so it starts at most len(stop) - 1 before it.
        window_start = max(0, len(self.pending) - new_chars - self._longest_stop + 1)
        hits = [i for s in self.stop if (i := self.pending.find(s, window_start)) != -1]
        if hits:
            self.pending = self.pending[: min(hits)]
            self.stopped = True

    def _release(self, final: bool) -> str:
        end = len(self.pending) if final else len(self.pending) - self._held_back()
        chunk, self.pending = self.pending[:end], self.pending[end:]
        return chunk

    def _held_back(self) -> int:
        """Length of the longest suffix of ``pending`` that is a proper prefix of a stop string."""
        return max((partial_stop(self.pending, stop) for stop in self.stop), default=0)


def partial_stop(text: str, stop: str) -> int:
    """Length of the longest suffix of ``text`` that is a proper prefix of ``stop``: tried only
    where ``stop``'s first character occurs among ``text``'s last ``len(stop) - 1``."""
    if len(stop) < 2:
        return 0
    tail = text[-(len(stop) - 1):]
    start = tail.find(stop[0])
    while start != -1:
        if stop.startswith(tail[start:]):
            return len(tail) - start
        start = tail.find(stop[0], start + 1)
    return 0
