"""How many tokens a request may generate, and how many it holds from its tenant's minute.

Pure, and the one place max_tokens' default is worked out. A request that leaves
``max_tokens`` out gets the default (the tenant's, else the operator's for the model, else
the model files' max_new_tokens, else OpenAI's: 16 on /v1/completions, the rest of the
context on chat), cut to
what the context and the tenant's per-minute budget can hold. A request that asks for more
than the limit, or for more than its tenant may ever spend in a minute, is a 400: asking
again later cannot help. Everything else is admitted as one reservation of its worst case,
``sum over prompts of (prompt + n * max_tokens)``; what the choices do not generate is
given back when the request ends (tenants/service.py).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.router.protocol.errors import ApiError, invalid_request
from kvflow.router.protocol.requests import SamplingOptions
from kvflow.router.serving.prompts import check_context
from kvflow.router.tenants.config import MaxTokensLimits

# OpenAI's defaults when nobody set one: 16 on the legacy endpoint; chat: None, the rest of
# the context.
OPENAI_DEFAULT_MAX_TOKENS = {"completion": 16, "chat": None}


def model_max_tokens(operator: MaxTokensLimits, files_default: int | None) -> MaxTokensLimits:
    """A model's limits: the operator's (`limits` in the gateway config), its default
    falling back to the model files' (generation_config.json's max_new_tokens), which its
    cap holds too."""
    if operator.default_max_tokens is not None or files_default is None:
        return operator
    limit = operator.max_tokens_limit
    return MaxTokensLimits(files_default if limit is None else min(files_default, limit), limit)


@dataclass(frozen=True)
class TokenPolicy:
    """The limits one request meets: its model's and its tenant's, merged."""

    default_max_tokens: int | None
    max_tokens_limit: int | None
    limit_owner: str  # who set the cap, for the error message
    tokens_per_minute: int | None
    tenant_name: str


def token_policy(
    model: MaxTokensLimits,
    tenant: MaxTokensLimits,
    *,
    tokens_per_minute: int | None,
    tenant_name: str,
    model_name: str,
) -> TokenPolicy:
    """The tighter cap wins; the tenant's default wins over the model's; a default above
    the cap is the cap."""
    owners = (
        (tenant.max_tokens_limit, f"tenant '{tenant_name}'"),
        (model.max_tokens_limit, f"model '{model_name}'"),
    )
    caps = [(cap, who) for cap, who in owners if cap is not None]
    limit, owner = min(caps, key=lambda c: c[0]) if caps else (None, "")
    default = tenant.default_max_tokens or model.default_max_tokens
    if default is not None and limit is not None:
        default = min(default, limit)
    return TokenPolicy(default, limit, owner, tokens_per_minute, tenant_name)


@dataclass(frozen=True)
class TokenBudget:
    max_tokens: tuple[int | None, ...]  # per prompt; None: up to the context (no limit set)
    reserved_tokens: int  # prompts + every choice's max_tokens: the admission's worst case


def _too_large_for_minute(
    reserved: int, prompt_lens: Sequence[int], n: int, policy: TokenPolicy, *, is_chat: bool
) -> ApiError:
    assert policy.tokens_per_minute is not None
    if n == 1 and sum(prompt_lens) + len(prompt_lens) > policy.tokens_per_minute:
        param = "messages" if is_chat else "prompt"  # not even one token each fits
    else:
        param = "n" if n > 1 else "max_tokens"
    return invalid_request(
        f"Request too large for tenant '{policy.tenant_name}' on tokens per minute: limit "
        f"{policy.tokens_per_minute}, requested {reserved} ({len(prompt_lens)} prompt(s) of "
        f"{sum(prompt_lens)} tokens in all, plus {n} choice(s) per prompt of up to max_tokens "
        "each). It can never be admitted: lower max_tokens, n or the number of prompts.",
        param=param,
        code="tokens_per_minute_exceeded",
    )


def plan_tokens(
    prompt_lens: Sequence[int],
    s: SamplingOptions,
    *,
    max_len: int,
    policy: TokenPolicy,
    is_chat: bool,
) -> TokenBudget:
    """Each prompt's max_tokens and the request's reservation, or the 400 that explains why
    the request can never run."""
    is_default = "max_tokens" in s.unset
    limit = policy.max_tokens_limit
    if not is_default and s.max_tokens is not None and limit is not None and s.max_tokens > limit:
        raise invalid_request(
            f"Invalid 'max_tokens': {s.max_tokens} is more than the limit of {limit} tokens "
            f"set for {policy.limit_owner} (max_tokens_limit); ask for fewer.",
            param="max_tokens",
            code="invalid_value",
        )
    wanted = s.max_tokens
    if is_default:
        openai = OPENAI_DEFAULT_MAX_TOKENS["chat" if is_chat else "completion"]
        wanted = openai if policy.default_max_tokens is None else policy.default_max_tokens
    if is_default and wanted is not None and policy.max_tokens_limit is not None:
        wanted = min(wanted, policy.max_tokens_limit)  # OpenAI's 16 is capped too
    max_tokens: list[int | None] = []
    for num_prompt in prompt_lens:
        if not is_default:
            check_context(num_prompt, wanted, max_len)
            max_tokens.append(wanted)
            continue
        check_context(num_prompt, None, max_len)
        # A default is cut to the context instead of failing the request.
        max_tokens.append(None if wanted is None else min(wanted, max_len - num_prompt))
    worst = [
        m if m is not None else max_len - p for m, p in zip(max_tokens, prompt_lens, strict=True)
    ]
    reserved = sum(prompt_lens) + s.n * sum(worst)
    tpm = policy.tokens_per_minute
    if tpm is not None and reserved > tpm:
        room = tpm - sum(prompt_lens)
        per_choice = room // (s.n * len(prompt_lens)) if room > 0 else 0
        if not is_default or per_choice < 1:
            raise _too_large_for_minute(reserved, prompt_lens, s.n, policy, is_chat=is_chat)
        # A default shrinks to what the tenant can spend in a minute.
        worst = [min(w, per_choice) for w in worst]
        max_tokens = list(worst)
        reserved = sum(prompt_lens) + s.n * sum(worst)
    for m in max_tokens:
        if m is not None and s.min_tokens > m:
            raise invalid_request(
                f"Invalid 'min_tokens': {s.min_tokens} is more than max_tokens ({m}"
                f"{', the default' if is_default else ''}).",
                param="min_tokens",
            )
    return TokenBudget(tuple(max_tokens), reserved)


def reservation_floor(num_prompts: int, s: SamplingOptions, policy: TokenPolicy) -> int:
    """The least `plan_tokens` can reserve for the request, known before its prompts are
    tokenized: every choice's max_tokens when the request set it (reserved as is), 1 when
    it did not (a default may shrink that far), and nothing for the prompts. The gateway
    checks the tenant's quotas against it before preparing the prompts: a request refused
    with it would be refused with its real reservation too. Capped by the tenant's tokens
    per minute and max_tokens cap: past those it is the 400 `plan_tokens` explains."""
    is_default = "max_tokens" in s.unset or s.max_tokens is None
    per_choice = 1 if is_default or s.max_tokens is None else s.max_tokens
    if policy.max_tokens_limit is not None:
        per_choice = min(per_choice, policy.max_tokens_limit)
    floor = num_prompts * s.n * per_choice
    tpm = policy.tokens_per_minute
    return floor if tpm is None else min(floor, tpm)
