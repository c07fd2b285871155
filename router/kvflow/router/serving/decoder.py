"""One choice's token stream -> text deltas: detokenize, cut at stop strings, logprobs.

Pure (a tokenizer and arithmetic); the service feeds it what the worker streams.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol

from kvflow.router.protocol.responses import ChoiceDelta, TokenLogprob, TopLogprob
from kvflow.router.text.detokenizer import IncrementalDetokenizer
from kvflow.router.text.stop import StopStringMatcher
from kvflow.router.text.tokenizer import TextTokenizer


class WorkerLogprobs(Protocol):
    """The worker's logprobs of one token (kvflow.proto TokenLogprobs)."""

    @property
    def logprob(self) -> float: ...

    @property
    def top_token_ids(self) -> Sequence[int]: ...

    @property
    def top_logprobs(self) -> Sequence[float]: ...


class ChoiceDecoder:
    def __init__(
        self,
        index: int,
        tokenizer: TextTokenizer,
        stop_strings: Sequence[str],
        *,
        with_logprobs: bool,
        num_top_logprobs: int,
        num_prompt_tokens: int = 0,
        include_stop_str: bool = False,
        skip_special_tokens: bool = True,
    ) -> None:
        self.index = index
        self._num_prompt_tokens = num_prompt_tokens
        self._tokenizer = tokenizer
        self._detokenizer = IncrementalDetokenizer(
            tokenizer, skip_special_tokens=skip_special_tokens
        )
        self._stops = (
            StopStringMatcher(stop_strings, include_stop=include_stop_str) if stop_strings else None
        )
        self._with_logprobs = with_logprobs
        self._num_top = num_top_logprobs
        self.num_tokens = 0

    @property
    def is_stopped(self) -> bool:
        """A stop string matched: the text is complete, the worker should stop."""
        return self._stops is not None and self._stops.is_stopped

    def _logprobs(
        self, token_ids: Sequence[int], logprobs: Sequence[WorkerLogprobs]
    ) -> tuple[TokenLogprob, ...]:
        if not self._with_logprobs:
            return ()
        out = []
        for token_id, lp in zip(token_ids, logprobs, strict=False):
            text, data = self._tokenizer.token_text(token_id)
            top = []
            for top_id, top_lp in list(zip(lp.top_token_ids, lp.top_logprobs, strict=False))[
                : self._num_top
            ]:
                top_text, top_data = self._tokenizer.token_text(top_id)
                top.append(TopLogprob(top_text, top_data, top_lp))
            out.append(TokenLogprob(text, data, lp.logprob, tuple(top)))
        return tuple(out)

    def feed(
        self, token_ids: Sequence[int], logprobs: Sequence[WorkerLogprobs]
    ) -> ChoiceDelta | None:
        """New tokens -> the delta to send now (None when there is nothing to send)."""
        if self.is_stopped:
            return None
        self.num_tokens += len(token_ids)
        text = self._detokenizer.push(token_ids)
        if self._stops is not None:
            text = self._stops.push(text)
        token_logprobs = self._logprobs(token_ids, logprobs)
        if not text and not token_logprobs:
            return None
        return ChoiceDelta(self.index, text, token_logprobs, None, *self._counts())

    def finish(self, finish_reason: str) -> ChoiceDelta:
        """The last delta: what was held back (unless a stop string ended it), the reason."""
        text = ""
        if not self.is_stopped:
            text = self._detokenizer.flush()
            if self._stops is not None:
                text = self._stops.push(text)
                text += self._stops.flush()
                if self._stops.is_stopped:  # the last characters completed a stop string
                    finish_reason = "stop"
        return ChoiceDelta(self.index, text, (), finish_reason, *self._counts())

    def _counts(self) -> tuple[int, int]:
        return self._num_prompt_tokens, self.num_tokens
