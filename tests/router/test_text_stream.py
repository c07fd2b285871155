"""Incremental detokenization and stop strings: exact text, never half a character."""

from __future__ import annotations

import pytest
from tokenizers import Tokenizer, decoders, models, pre_tokenizers

from kvflow.router.text.detokenizer import IncrementalDetokenizer
from kvflow.router.text.model_files import default_model_path, load_text_model
from kvflow.router.text.stop import StopStringMatcher
from kvflow.router.text.tokenizer import TextTokenizer

TEXTS = [
    "emoji 🙂🚀👩‍👩‍👧 and 日本語 and ça",
    "plain ascii text, with numbers 123",
    "🇫🇷🇩🇪" * 5,
]


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return load_text_model(default_model_path()).tokenizer


@pytest.mark.parametrize("text", TEXTS)
def test_one_token_at_a_time_never_splits_a_character(tokenizer, text: str) -> None:
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids]
    pieces.append(detok.flush())
    assert "".join(pieces) == text
    assert not any("\ufffd" in p for p in pieces)
    # An emoji is several byte tokens: some pushes must have held text back.
    if any(ord(ch) > 0xFFFF for ch in text):
        assert "" in pieces[:-1]


def test_special_tokens_are_dropped(tokenizer) -> None:
    ids = tokenizer.encode("<|im_start|>assistant\nHi<|im_end|>", add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids) + detok.flush() == "assistant\nHi"


def test_special_tokens_kept_by_name_when_asked(tokenizer) -> None:
    # vLLM's skip_special_tokens=false, on both detokenizer paths.
    text = "<|im_start|>assistant\nHi 🙂<|im_end|>"
    ids = tokenizer.encode(text, add_special_tokens=False)
    detok = IncrementalDetokenizer(tokenizer, skip_special_tokens=False)
    assert "".join(detok.push([t]) for t in ids) + detok.flush() == text
    window = IncrementalDetokenizer(_metaspace_tokenizer(), skip_special_tokens=False)
    assert window.push([1, 2]) + window.flush() == "hello world"


def test_a_truncated_character_becomes_one_replacement_char(tokenizer) -> None:
    ids = tokenizer.encode("🙂", add_special_tokens=False)
    assert len(ids) > 1
    detok = IncrementalDetokenizer(tokenizer)
    assert detok.push(ids[:-1]) == ""
    assert detok.flush() == "\ufffd"


def _metaspace_tokenizer() -> TextTokenizer:
    # A SentencePiece-style tokenizer: spaces become "▁" and merge across tokens on decode,
    # so it takes the windowed path.
    vocab = {"[UNK]": 0, "▁hello": 1, "▁world": 2, "▁": 3, "h": 4, "i": 5}
    backend = Tokenizer(models.WordLevel(vocab=vocab, unk_token="[UNK]"))
    backend.pre_tokenizer = pre_tokenizers.Metaspace()
    backend.decoder = decoders.Metaspace()
    return TextTokenizer(backend, frozenset(), is_byte_level=False, bos_token="", eos_token="")


def test_window_detokenizer_for_non_byte_level_tokenizers() -> None:
    tokenizer = _metaspace_tokenizer()
    ids = [1, 2, 1]
    detok = IncrementalDetokenizer(tokenizer)
    pieces = [detok.push([t]) for t in ids] + [detok.flush()]
    assert "".join(pieces) == tokenizer.decode(ids) == "hello world hello"


@pytest.mark.parametrize(
    ("stops", "chunks", "emitted", "stopped"),
    [
        (["END"], ["abc", "dEN", "Dxyz"], ["abc", "d", ""], True),
        (["END"], ["abc", "dEN", "d"], ["abc", "d", "ENd"], False),
        (["\n\n"], ["a\n", "\nb"], ["a", ""], True),
        (["stop", "st"], ["xxstop"], ["xx"], True),
        (["ab", "b"], ["cab"], ["c"], True),  # the earliest match wins, not the first listed
        (["."], ["Paris. Then"], ["Paris"], True),
        (["abc"], ["a", "b", "x"], ["", "", "abx"], False),
        (["aab"], ["aa", "ab"], ["", "a"], True),  # overlapping prefix: "a|aab"
    ],
)
def test_stop_strings_cut_exactly(stops, chunks, emitted, stopped) -> None:
    matcher = StopStringMatcher(stops)
    out = [matcher.push(c) for c in chunks]
    assert out == emitted
    assert matcher.is_stopped is stopped
    if stopped:
        assert matcher.push("more") == ""


@pytest.mark.parametrize(
    ("stops", "chunks", "emitted"),
    [
        (["END"], ["abc", "dEN", "Dxyz"], ["abc", "d", "END"]),
        (["stop", "st"], ["xxstop"], ["xxstop"]),  # at one position, the longest string
        (["ab", "b"], ["cab"], ["cab"]),
    ],
)
def test_stop_strings_kept_when_asked(stops, chunks, emitted) -> None:
    # vLLM's include_stop_str_in_output: the text ends with the stop string that ended it.
    matcher = StopStringMatcher(stops, include_stop=True)
    assert [matcher.push(c) for c in chunks] == emitted and matcher.is_stopped


def test_held_text_is_released_at_the_end() -> None:
    matcher = StopStringMatcher(["END"])
    assert matcher.push("the EN") == "the "
    assert matcher.flush() == "EN"
    assert not matcher.is_stopped
