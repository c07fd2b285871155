"""The per-request logits-processor hook: a constraint on which token may come next.

A request may carry one ``LogitsProcessor`` in ``SamplingParams.logits_processor`` (set by
the worker when it admits the request, e.g. a compiled grammar for JSON-schema output).
The sampler asks it once per sampled step and masks every token it disallows before
greedy or random sampling, in one batched ``masked_fill`` over all constrained rows.

Contract (``allowed_token_mask``):

- Called on the engine thread, once per step in which the request samples a token
  (never for a prefill chunk that does not reach the end of the prompt), in batch order.
  It must be fast: the whole batch waits for it (budget: well under 1 ms; a step of
  SmolLM2 at batch 64 takes tens of ms on a GPU).
- ``output_token_ids`` are the request's sampled tokens so far (prompt excluded), in
  order; the previous call's chosen token is the last one. A preempted request resumes
  with the same list, so a stateful processor advances over the tokens it has not yet
  seen (``output_token_ids[num_seen:]``) instead of counting calls.
- Returns a ``torch.bool`` tensor of shape ``[n]`` with ``n <= vocab_size`` (the logits'
  width), on any device: True where the token may be sampled. Tokens at or past ``n``
  are disallowed (a model's embedding is often padded past the tokenizer's vocabulary).
  Or returns None: no constraint this step.
- The mask must allow at least one token. If it allows only tokens that ``min_tokens``
  forbids (EOS, stop tokens), the processor wins: its set is sampled from unmasked.
- Logprobs stay those of the model's raw distribution, as for every other filter.
- Never raise for a token the sampler chose: it is always one the mask allowed.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, runtime_checkable

import torch


@runtime_checkable
class LogitsProcessor(Protocol):
    def allowed_token_mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        """Bool ``[n <= vocab_size]``, True where the next token may be sampled; None: any."""
        ...


class GuardedProcessor:
    """A request's processor whose exceptions fail that request, not the batch: the error
    is recorded in ``failed`` under the request's id (the engine loop ends the request
    after the step and drops its token) and this step goes on unconstrained for it."""

    def __init__(
        self, inner: LogitsProcessor, request_id: str, failed: dict[str, BaseException]
    ) -> None:
        self.inner = inner
        self._request_id = request_id
        self._failed = failed  # the engine loop's; only the engine thread touches it

    def allowed_token_mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        try:
            mask = self.inner.allowed_token_mask(output_token_ids)
            if mask is not None and (mask.dtype != torch.bool or mask.dim() != 1):
                raise TypeError(f"a mask of {mask.dtype} {tuple(mask.shape)}, not bool [n]")
        except Exception as exc:
            self._failed.setdefault(self._request_id, exc)
            return None
        return mask
