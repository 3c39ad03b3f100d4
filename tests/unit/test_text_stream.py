"""TextCodec and TextStream with the prepared model's real tokenizer: incremental
detokenization matches a one-shot decode, and stop strings are cut without ever
leaking part of a stop string to the client."""

from __future__ import annotations

import pytest

from foundation.model_prep import resolve_model
from orchestrator.tokenization import PromptError, TextCodec, TextStream, partial_stop


@pytest.fixture(scope="module")
def codec() -> TextCodec:
    return TextCodec(resolve_model(None))


def ids_of(codec: TextCodec, text: str) -> list[int]:
    return codec.tokenizer.encode(text, add_special_tokens=False).ids


def one_by_one(stream: TextStream, token_ids: list[int]) -> list[str]:
    """The chunks a client would see, one push per token, then finish()."""
    return [stream.push([token]) for token in token_ids] + [stream.finish()]


TEXTS = [
    "Hello World, how are you?",
    " leading space and\n\nnewlines\tand tabs  double  spaces ",
    "Héllo wörld — ünïcödé, ﬁ ligature, naïve café",
    "日本語のテキストと中文和한국어",
    "emoji 🙂🎉 and a skin tone 👍🏽 and a family 👨‍👩‍👧 end",
    "mixed: x² ≤ ∞, €5, 🚀launch🚀",
    "code: def f(x):\n    return {'a': [1, 2]}  # ok",
]


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_matches_decode(codec, text):
    token_ids = ids_of(codec, text)
    expected = codec.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert expected == text  # sanity: the tokenizer round-trips these
    chunks = one_by_one(codec.text_stream([]), token_ids)
    assert "".join(chunks) == expected
    # Never half a character: every chunk is valid text without replacement characters.
    assert all("\ufffd" not in chunk for chunk in chunks)


@pytest.mark.parametrize("text", TEXTS)
@pytest.mark.parametrize("chunk_size", [2, 3, 7, 1000])
def test_chunked_pushes_match_decode(codec, text, chunk_size):
    token_ids = ids_of(codec, text)
    stream = codec.text_stream([])
    out = "".join(stream.push(token_ids[i:i + chunk_size]) for i in range(0, len(token_ids), chunk_size))
    assert out + stream.finish() == text


def test_special_tokens_are_skipped(codec):
    special = [codec.tokenizer.token_to_id(codec.special_tokens[name]) for name in ("bos_token", "unk_token")]
    special.append(codec.eos_token_id)
    token_ids = ([codec.eos_token_id] + ids_of(codec, "Hi") + special + ids_of(codec, " there 🙂")
                 + [codec.eos_token_id])
    expected = codec.tokenizer.decode(token_ids, skip_special_tokens=True)
    assert expected == "Hi there 🙂"
    assert "".join(one_by_one(codec.text_stream([]), token_ids)) == expected


def test_multibyte_characters_wait_for_their_last_byte(codec):
    # The emoji is split over several byte-level tokens; nothing is released until it is whole.
    token_ids = ids_of(codec, "a🎉")
    assert len(token_ids) > 2
    chunks = one_by_one(codec.text_stream([]), token_ids)
    assert [c for c in chunks if c] == ["a", "🎉"]


def test_stop_inside_one_token(codec):
    stream = codec.text_stream(["World"])
    assert stream.push(ids_of(codec, "Hello")) == "Hello"
    assert not stream.stopped
    # " World" is one token: the text before the stop is released, the stop is not.
    assert stream.push(ids_of(codec, " World")) == " "
    assert stream.stopped
    assert stream.pending == ""
    # Further tokens and finish() add nothing.
    assert stream.push(ids_of(codec, ", how are you?")) == ""
    assert stream.finish() == ""


def test_possible_stop_prefix_is_held_back_until_decided_as_stop(codec):
    stream = codec.text_stream(["World"])
    assert stream.push(ids_of(codec, "Hello")) == "Hello"
    # "Hello Wor": " " is safe, "Wor" could still become "World" and is held back.
    assert ids_of(codec, " Wor") == [ids_of(codec, "Hello Wor")[-1]]
    assert stream.push(ids_of(codec, " Wor")) == " "
    assert not stream.stopped
    assert stream.push(ids_of(codec, "ld")) == ""
    assert stream.stopped
    assert stream.finish() == ""


def test_possible_stop_prefix_is_released_once_decided_not_a_stop(codec):
    stream = codec.text_stream(["World"])
    assert stream.push(ids_of(codec, "Hello")) == "Hello"
    assert stream.push(ids_of(codec, " Wor")) == " "
    assert stream.push(ids_of(codec, "st")) == "Worst"
    assert not stream.stopped


def test_finish_releases_held_back_text(codec):
    stream = codec.text_stream(["World"])
    out = "".join(stream.push([token]) for token in ids_of(codec, "Hello Wor"))
    assert out == "Hello "
    assert stream.finish() == "Wor"
    assert not stream.stopped
    assert stream.finish() == ""


def test_stop_spanning_several_tokens(codec):
    text = "The answer is STOP_HERE now"
    token_ids = ids_of(codec, text)
    pieces = [codec.tokenizer.decode([t]) for t in token_ids]
    stop = "STOP_HERE"
    # The stop string really is spread over several tokens.
    assert sum(1 for p in pieces if p.strip() and p.strip() in stop) >= 3
    stream = codec.text_stream([stop])
    chunks = one_by_one(stream, token_ids)
    assert "".join(chunks) == "The answer is "
    assert stream.stopped
    # Not one character of the stop string was ever released.
    released = ""
    for chunk in chunks:
        released += chunk
        assert "S" not in released


def test_stop_inside_multibyte_text(codec):
    stream = codec.text_stream(["本"])
    out = "".join(one_by_one(stream, ids_of(codec, "abc 日本語 🙂 ok")))
    assert out == "abc 日"
    assert stream.stopped


def test_emoji_stop(codec):
    stream = codec.text_stream(["🙂"])
    out = "".join(one_by_one(stream, ids_of(codec, "abc 日本語 🙂 ok")))
    assert out == "abc 日本語 "
    assert stream.stopped


@pytest.mark.parametrize("stops", [["four", "two"], ["two", "four"], ["three", "two", "four"]])
def test_several_stops_earliest_wins(codec, stops):
    stream = codec.text_stream(stops)
    out = "".join(one_by_one(stream, ids_of(codec, "one two three four")))
    assert out == "one "
    assert stream.stopped


@pytest.mark.parametrize("stops", [["ld", "Wor"], ["Wor", "ld"]])
def test_several_stops_in_one_piece_earliest_position_wins(codec, stops):
    # " World" arrives as one piece that contains both stops; the one that starts first cuts.
    stream = codec.text_stream(stops)
    assert stream.push(ids_of(codec, "Hello World!")) == "Hello "
    assert stream.stopped


def test_several_stops_hold_back_the_longest_possible_prefix(codec):
    stream = codec.text_stream(["Wonder", "World"])
    assert stream.push(ids_of(codec, "Hello Wor")) == "Hello "
    assert stream.finish() == "Wor"


def test_no_stop_prefix_ever_released_early(codec):
    """At every step, released text is a prefix of the final text and never ends inside
    something that later turned out to be the stop string."""
    stop = "<END>"
    text = "a<b <E <EN x <END> tail"
    final = "a<b <E <EN x "
    stream = codec.text_stream([stop])
    released = ""
    for token in ids_of(codec, text):
        released += stream.push([token])
        assert final.startswith(released)
        # Whatever is held back is exactly the longest tail that could still start "<END>".
        text = released + stream.pending
        could_start_stop = max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)
        assert len(stream.pending) == (0 if stream.stopped else could_start_stop)
    released += stream.finish()
    assert released == final
    assert stream.stopped


def test_only_the_unreleased_text_is_kept_however_long_the_output(codec):
    """The stop check looks at new text plus the longest stop, not the whole output: four
    stop strings of 256 characters over 20,000 tokens keep under 256 characters + a piece."""
    stops = ["x" * 255 + "!", "y" * 256, "ab" * 128, "<" + "z" * 255]
    token_ids = ids_of(codec, "ab xx yy <zz " * 50)
    stream = codec.text_stream(stops)
    released, longest_pending = "", 0
    for _ in range(40):
        for token in token_ids:
            released += stream.push([token])
            longest_pending = max(longest_pending, len(stream.pending))
    assert not stream.stopped and released + stream.finish() == "ab xx yy <zz " * 50 * 40
    assert longest_pending < 256 + 16


@pytest.mark.parametrize("text, stop, expected", [
    ("hello wor", "world", 3), ("hello", "world", 0), ("aaaa", "aaab", 3), ("abab", "abac", 2),
    ("xab", "abab", 2), ("a", "a", 0), ("", "ab", 0), ("zzab", "abc", 2), ("abcab", "abcabd", 5),
])
def test_partial_stop_is_the_longest_suffix_that_starts_a_stop(text, stop, expected):
    assert partial_stop(text, stop) == expected
    assert expected == max((k for k in range(1, len(stop)) if text.endswith(stop[:k])), default=0)


def test_text_without_stop_passes_through(codec):
    text = "Hello Wonderful world"
    stream = codec.text_stream(["World", "xyz"])
    assert "".join(one_by_one(stream, ids_of(codec, text))) == text
    assert not stream.stopped


def test_streams_are_independent(codec):
    first, second = codec.text_stream(["b"]), codec.text_stream([])
    first.push(ids_of(codec, "abc"))
    assert first.stopped and not second.stopped
    assert second.push(ids_of(codec, "abc")) == "abc"


def test_encode_chat_applies_template(codec):
    messages = [{"role": "system", "content": "Be terse."},
                {"role": "user", "content": "What is the capital of France?"}]
    token_ids = codec.encode_chat(messages)
    assert all(isinstance(t, int) for t in token_ids)
    text = codec.tokenizer.decode(token_ids, skip_special_tokens=False)
    assert "Be terse." in text
    assert "What is the capital of France?" in text
    header = codec.tokenizer.encode("<|im_start|>assistant\n", add_special_tokens=False).ids
    assert header[0] == codec.tokenizer.token_to_id("<|im_start|>")
    assert token_ids[-len(header):] == header
    assert text.endswith("<|im_start|>assistant\n")
    # The user's text is a run of its own tokens inside the prompt.
    user_ids = ids_of(codec, "What is the capital of France?")
    assert any(token_ids[i:i + len(user_ids)] == user_ids for i in range(len(token_ids)))


def test_encode_chat_multi_turn_order(codec):
    token_ids = codec.encode_chat([{"role": "user", "content": "first question"},
                                   {"role": "assistant", "content": "first answer"},
                                   {"role": "user", "content": "second question"}])
    text = codec.tokenizer.decode(token_ids)
    assert text.index("first question") < text.index("first answer") < text.index("second question")


@pytest.mark.parametrize("messages", [[], [{"role": "user"}], [{"role": "user", "content": None}]])
def test_encode_chat_template_errors_are_prompt_errors(codec, messages):
    with pytest.raises(PromptError, match="chat template"):
        codec.encode_chat(messages)


def test_encode_text(codec):
    assert codec.tokenizer.decode(codec.encode_text("Hello world")) == "Hello world"


def test_check_token_ids_accepts_the_vocabulary(codec):
    codec.check_token_ids([])
    codec.check_token_ids([0, 1, codec.vocab_size - 1])
    codec.check_token_ids(ids_of(codec, "any text 🙂"))


@pytest.mark.parametrize("bad", [[-1], [10, 49152], [10**9], [5, -3, 7]])
def test_check_token_ids_rejects_ids_outside_the_vocabulary(codec, bad):
    assert codec.vocab_size == 49152
    with pytest.raises(PromptError, match="outside the vocabulary") as info:
        codec.check_token_ids(bad)
    offending = [t for t in bad if not 0 <= t < codec.vocab_size]
    assert str(offending) in str(info.value)
    assert str(codec.vocab_size - 1) in str(info.value)


CHATS = [
    [{"role": "user", "content": "What is the capital of Germany?"}],
    [{"role": "system", "content": "You answer in one word."}, {"role": "user", "content": "Sky colour?"}],
    [{"role": "user", "content": "Hi"}, {"role": "assistant", "content": "Hello! 🙂"},
     {"role": "user", "content": "日本語で答えて\n\n  with  spaces "}],
]


@pytest.fixture(scope="module")
def reference(codec):
    """transformers' own tokenizer of the same model, which the router matches without torch."""
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(resolve_model(None))


@pytest.mark.parametrize("messages", CHATS)
def test_chat_ids_match_transformers(codec, reference, messages):
    expected = reference.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)
    expected = expected["input_ids"] if hasattr(expected, "keys") else expected
    assert codec.encode_chat(messages) == list(expected)


@pytest.mark.parametrize("text", TEXTS)
def test_text_ids_match_transformers(codec, reference, text):
    assert codec.encode_text(text) == list(reference(text)["input_ids"])
    assert codec.vocab_size == len(reference) and codec.eos_token_id == reference.eos_token_id

