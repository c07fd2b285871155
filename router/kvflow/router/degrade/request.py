"""What each active step does to one request (pure).

- cap_max_tokens: at most ``cap`` tokens per choice. A max_tokens the request set above the
  cap is lowered here (and min_tokens with it, so the request stays valid); one it left out
  is capped once its default is worked out (`cap_budget`, after serving/token_budget.py).
- drop_extras: the request loses its tools (and tool_choice), its output format
  (response_format, structured_outputs, a forced tool call) and its logprobs: the answer is
  plain text, which costs a worker no grammar masking and no logprob math.
- fallback_model: the request's `model` becomes the fallback's name, so routing, the
  tenant's token policy, prices and the response's `model` are the fallback's.

Each function says whether it changed the request: the response's `x-kvflow-degraded`
header names only the steps that did.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from kvflow.router.protocol.requests import ChatRequest, CompletionRequest
from kvflow.router.serving.token_budget import TokenBudget
from kvflow.router.tools.spec import ToolChoice

AnyRequest = ChatRequest | CompletionRequest


def cap_request(request: AnyRequest, cap: int) -> tuple[AnyRequest, bool]:
    """A max_tokens the request set, lowered to ``cap``."""
    s = request.sampling
    if "max_tokens" in s.unset or s.max_tokens is None or s.max_tokens <= cap:
        return request, False
    sampling = replace(s, max_tokens=cap, min_tokens=min(s.min_tokens, cap))
    return replace(request, sampling=sampling), True


def cap_budget(
    budget: TokenBudget, prompt_lens: Sequence[int], n: int, cap: int
) -> tuple[TokenBudget, bool]:
    """Each prompt's planned max_tokens at most ``cap`` (None, up to the context, becomes
    the cap), and the reservation recomputed from them."""
    if all(m is not None and m <= cap for m in budget.max_tokens):
        return budget, False
    capped = tuple(cap if m is None else min(m, cap) for m in budget.max_tokens)
    return TokenBudget(capped, sum(prompt_lens) + n * sum(capped)), True


def drop_extras(request: AnyRequest) -> tuple[AnyRequest, bool]:
    """Without tools, output format and logprobs."""
    s = request.sampling
    has_tools = isinstance(request, ChatRequest) and (
        bool(request.tools) or request.tool_choice.mode != "none"
    )
    if not (has_tools or s.constraint is not None or s.logprobs or s.top_logprobs):
        return request, False
    sampling = replace(s, constraint=None, logprobs=False, top_logprobs=0)
    if isinstance(request, ChatRequest):
        return replace(request, sampling=sampling, tools=(), tool_choice=ToolChoice("none")), True
    return replace(request, sampling=sampling), True


def fall_back(request: AnyRequest, fallback_model: str) -> AnyRequest:
    return replace(request, model=fallback_model)
