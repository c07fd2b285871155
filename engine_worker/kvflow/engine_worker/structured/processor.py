"""A request's grammar as the sampler's per-request ``LogitsProcessor``.

Each step it advances the matcher over the tokens sampled since its last call, computes
the allowed set (a bitmask, one bit per token id, filled by llguidance in Rust with the
GIL released) and unpacks it to the bool mask the sampler wants. Measured on one CPU core
for SmolLM2's 49,152-token vocabulary: ~30 us to fill the bitmask mid-JSON and ~14 us to
unpack it with numpy (a torch shift-and-mask took ~30 us; llguidance's one-byte-per-token
``compute_logit_bias`` ~370 us); bench/structured_mask.py measures it.
"""

from __future__ import annotations

import time
from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.structured.grammar import GrammarCompiler, GrammarSpec

# The most CPU one row's mask may take on the engine thread: a format's mask takes about
# 30 us (bench/structured_mask.py), at most 0.7 ms measured on SmolLM2's vocabulary for a
# 2,700-link reference chain, a 100-property object and the tool schemas of the tests;
# `(x{700}){700}` takes 37 ms. Past this the request is refused, not the batch slowed.
MAX_MASK_S = 0.01
# The most of llguidance's message a refusal quotes.
MAX_ERROR_CHARS = 300
# llguidance's words for a token its grammar refused (not for a limit it ran into).
_REFUSED_TOKEN = "doesn't satisfy the grammar"


class GrammarLogitsProcessor:
    """Stateful: one per request. A matcher that ends in an error state (the grammar past
    one of llguidance's limits at run time: its lexer's fuel, a row's items, as a large
    regex repetition or a schema of hundreds of optional properties reach) raises
    InvalidRequestError: the engine loop fails this request alone
    (logits_processor.GuardedProcessor) and the caller hears why, where allowing only EOS
    had answered a 200 cut short, its output not of the format, and said nothing. A token
    the grammar refused (sampled on a step left unconstrained) still allows only EOS."""

    def __init__(
        self,
        matcher: llguidance.LLMatcher,
        vocab_size: int,
        eos_token_ids: Sequence[int],
    ) -> None:
        self._matcher = matcher
        self._num_seen = 0
        self._vocab_size = vocab_size
        # One 32-bit word per 32 token ids; reused every step (no allocation per step).
        self._words = np.zeros((vocab_size + 31) // 32, dtype=np.int32)
        self._eos_only = torch.zeros(vocab_size, dtype=torch.bool)
        self._eos_only[list(eos_token_ids)] = True
        self._first: torch.Tensor | None = None  # the mask before any token, computed ahead

    @classmethod
    def compile(cls, compiler: GrammarCompiler, spec: GrammarSpec) -> GrammarLogitsProcessor:
        """Raises InvalidRequestError when the format does not compile. Its first mask is
        computed here too, off the engine thread (the first of a costly format takes
        the longest: about a second for `(x{700}){700}`)."""
        processor = cls(compiler.matcher(spec), compiler.vocab_size, compiler.eos_token_ids)
        processor._first = processor._mask()
        return processor

    @property
    def error(self) -> str:
        return self._matcher.get_error()

    def allowed_token_mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        new = output_token_ids[self._num_seen :]
        self._num_seen = len(output_token_ids)
        matcher = self._matcher
        if new and not matcher.is_error():
            matcher.consume_tokens(list(new))
        if matcher.is_error():
            if _REFUSED_TOKEN in matcher.get_error():
                # A token the mask did not allow (a step run unconstrained): end the request.
                return self._eos_only
            # Its first line: the rest is the parser's state and the whole grammar (15 KB
            # here), past what a gRPC status may carry.
            why = matcher.get_error().partition("\n")[0][:MAX_ERROR_CHARS]
            raise InvalidRequestError(
                f"the output format cannot be followed: {why} (simplify the schema, regex or "
                "grammar)"
            )
        if not output_token_ids and self._first is not None:
            return self._first
        # This thread's CPU time (llguidance computes on it): a step descheduled on a busy
        # machine is not the format's cost.
        started_s = time.thread_time()
        mask = self._mask()
        took_s = time.thread_time() - started_s
        if took_s > MAX_MASK_S:
            # Every step of the batch waits for every row's mask: one format this costly
            # slowed every request on the worker (four of them: 0.56 s a step).
            raise InvalidRequestError(
                f"the output format costs {took_s * 1000:.0f} ms a token to follow, more than "
                f"the {MAX_MASK_S * 1000:.0f} ms a step allows it (a nested repetition such "
                "as (x{700}){700} does): simplify the schema, regex or grammar"
            )
        return mask

    def _mask(self) -> torch.Tensor:
        self._matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self._vocab_size].view(np.bool_))
