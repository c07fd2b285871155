"""One choice's token stream to deltas: text, stop strings, finish, logprobs."""

from __future__ import annotations

from dataclasses import dataclass, field

import pytest

from kvflow.router.protocol.responses import ChoiceResult
from kvflow.router.serving.decoder import ChoiceDecoder
from kvflow.router.text.model_files import load_text_model
from kvflow.router.text.tokenizer import TextTokenizer


@dataclass
class Logprobs:
    logprob: float
    top_token_ids: list[int] = field(default_factory=list)
    top_logprobs: list[float] = field(default_factory=list)


@pytest.fixture(scope="module")
def tokenizer() -> TextTokenizer:
    return load_text_model(None).tokenizer


def run(decoder: ChoiceDecoder, token_ids: list[int], reason: str = "length") -> ChoiceResult:
    result = ChoiceResult(decoder.index)
    for token in token_ids:
        delta = decoder.feed([token], [Logprobs(-0.5, [token, 7], [-0.5, -2.0])])
        if delta is not None:
            result.add(delta)
        if decoder.is_stopped:
            result.add(decoder.finish("stop"))
            return result
    result.add(decoder.finish(reason))
    return result


def test_text_and_finish(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("Hello there, friend 🙂!", add_special_tokens=False)
    decoder = ChoiceDecoder(2, tokenizer, (), with_logprobs=False, num_top_logprobs=0)
    result = run(decoder, ids)
    assert (result.index, result.text, result.finish_reason) == (
        2,
        "Hello there, friend 🙂!",
        "length",
    )
    assert result.logprobs == [] and decoder.num_tokens == len(ids)


def test_stop_string_cuts_and_stops(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("one two three four", add_special_tokens=False)
    decoder = ChoiceDecoder(0, tokenizer, (" thr",), with_logprobs=False, num_top_logprobs=0)
    result = run(decoder, ids)
    assert (result.text, result.finish_reason) == ("one two", "stop")
    assert decoder.feed([5], []) is None  # nothing after the stop


def test_a_stop_string_completed_by_the_last_token(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("abc END", add_special_tokens=False)
    decoder = ChoiceDecoder(0, tokenizer, ("END",), with_logprobs=False, num_top_logprobs=0)
    result = run(decoder, ids)
    assert (result.text, result.finish_reason) == ("abc ", "stop")


def test_logprobs_carry_token_text_and_bytes(tokenizer: TextTokenizer) -> None:
    ids = tokenizer.encode("Hi 🙂", add_special_tokens=False)
    decoder = ChoiceDecoder(0, tokenizer, (), with_logprobs=True, num_top_logprobs=1)
    result = run(decoder, ids)
    assert len(result.logprobs) == len(ids)
    assert b"".join(lp.token_bytes for lp in result.logprobs) == "Hi 🙂".encode()
    assert all(lp.logprob == -0.5 and len(lp.top) == 1 for lp in result.logprobs)
    assert result.logprobs[0].top[0].token == result.logprobs[0].token
