"""A request's grammar as the sampler's per-request ``LogitsProcessor``.

Each step it advances the matcher over the tokens sampled since its last call, computes
the allowed set (a bitmask, one bit per token id, filled by llguidance in Rust with the
GIL released) and unpacks it to the bool mask the sampler wants. Measured on one CPU core
for SmolLM2's 49,152-token vocabulary: ~30 us to fill the bitmask mid-JSON and ~14 us to
unpack it with numpy (a torch shift-and-mask took ~30 us; llguidance's one-byte-per-token
``compute_logit_bias`` ~370 us); bench/structured_mask.py measures it.
"""

from __future__ import annotations

from collections.abc import Sequence

import llguidance
import numpy as np
import torch

from kvflow.engine_worker.structured.grammar import GrammarCompiler, GrammarSpec


class GrammarLogitsProcessor:
    """Stateful: one per request. Never raises on the engine thread; a matcher that ends in
    an error state (a bug, or a token it did not allow) allows only EOS, so the request
    ends instead of the batch failing."""

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

    @classmethod
    def compile(cls, compiler: GrammarCompiler, spec: GrammarSpec) -> GrammarLogitsProcessor:
        """Raises InvalidRequestError when the format does not compile."""
        return cls(compiler.matcher(spec), compiler.vocab_size, compiler.eos_token_ids)

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
            return self._eos_only
        matcher.unsafe_compute_mask_ptr(self._words.ctypes.data, self._words.nbytes)
        bits = np.unpackbits(self._words.view(np.uint8), bitorder="little")
        return torch.from_numpy(bits[: self._vocab_size].view(np.bool_))
