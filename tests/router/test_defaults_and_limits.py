"""Defaults that protect the service, the pure parts: the model's sampling defaults, the
max_tokens default and cap (model and tenant), the per-minute token reservation of prompt
arrays and `n`, and the quota store that holds it. Exact numbers throughout."""

from __future__ import annotations

import asyncio
import json
import shutil
from pathlib import Path
from typing import Any

import pytest
from testkit.tokenizer_files import write_smollm2_tokenizer

from kvflow.router.protocol.errors import ApiError
from kvflow.router.protocol.requests import parse_chat_request, parse_completion_request
from kvflow.router.serving.defaults import apply_sampling_defaults, model_sampling_defaults
from kvflow.router.serving.token_budget import (
    TokenPolicy,
    model_max_tokens,
    plan_tokens,
    reservation_floor,
    token_policy,
)
from kvflow.router.settings import ConfigError, parse_config
from kvflow.router.tenants.config import (
    MaxTokensLimits,
    Quotas,
    Tenant,
    TenantConfigError,
    hash_api_key,
    parse_tenants,
)
from kvflow.router.tenants.store import MemoryQuotaStore
from kvflow.router.text.generation_config import (
    SamplingDefaults,
    from_generation_config,
    from_gguf_metadata,
)
from kvflow.router.text.model_files import (
    BUILTIN_MODEL_SAMPLING,
    default_model_path,
    load_text_model,
)

CHAT: dict[str, Any] = {"model": "m", "messages": [{"role": "user", "content": "hi"}]}
NO_LIMITS = TokenPolicy(None, None, "", None, "t")

# -- the model's own sampling defaults ---------------------------------------------------------


def test_generation_config_fields_become_defaults_and_bad_values_are_dropped() -> None:
    config = {"bos_token_id": 1, "do_sample": True, "temperature": 0.6, "top_p": 0.95,
              "top_k": 20, "min_p": 0, "repetition_penalty": 1.05,
              "max_new_tokens": 2048}  # fmt: skip
    assert from_generation_config(config, "g.json") == SamplingDefaults(
        temperature=0.6, top_p=0.95, top_k=20, min_p=0.0, repetition_penalty=1.05,
        max_tokens=2048,
    )  # fmt: skip
    bad = {"temperature": 7, "top_p": "high", "top_k": 0, "repetition_penalty": 0}
    assert from_generation_config(bad, "g.json") == SamplingDefaults()
    # top_p 0 keeps no token (a request may not ask for it), NaN is no number
    odd = {"top_p": 0.0, "temperature": float("nan"), "min_p": float("inf")}
    assert from_generation_config(odd, "g.json") == SamplingDefaults()
    # Only token ids (as many models' generation_config.json): no defaults at all.
    assert from_generation_config({"bos_token_id": 1, "eos_token_id": 2}, "g") == SamplingDefaults()


def test_gguf_sampling_metadata_becomes_defaults() -> None:
    metadata = {"general.sampling.temp": 0.7, "general.sampling.top_k": 40,
                "general.sampling.penalty_repeat": 1.1, "general.name": "x"}  # fmt: skip
    assert from_gguf_metadata(metadata, "m.gguf") == SamplingDefaults(
        temperature=0.7, top_k=40, repetition_penalty=1.1
    )


def test_builtin_model_declares_its_model_card_defaults(tmp_path: Path) -> None:
    model = load_text_model(None)
    assert (
        model.sampling_defaults
        == BUILTIN_MODEL_SAMPLING
        == SamplingDefaults(temperature=0.2, top_p=0.9)
    )
    # Another GGUF without general.sampling.* (a copy of the same file) gets none.
    copy = tmp_path / "other.gguf"
    shutil.copyfile(default_model_path(), copy)
    assert load_text_model(copy).sampling_defaults == SamplingDefaults()


def test_a_folders_generation_config_is_read(tmp_path: Path) -> None:
    folder = write_smollm2_tokenizer(tmp_path)
    (folder / "generation_config.json").write_text(json.dumps({"temperature": 0.3, "top_k": 5}))
    model = load_text_model(folder)
    assert model.sampling_defaults == SamplingDefaults(temperature=0.3, top_k=5)


def test_defaults_fill_only_what_the_request_left_out() -> None:
    defaults = SamplingDefaults(temperature=0.2, top_p=0.9, top_k=40, min_p=0.05,
                                repetition_penalty=1.1)  # fmt: skip
    s = apply_sampling_defaults(parse_chat_request(CHAT).sampling, defaults)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (
        0.2, 0.9, 40, 0.05, 1.1)  # fmt: skip
    # Explicit values win, even OpenAI's own defaults and zeros.
    body = {**CHAT, "temperature": 1.0, "top_p": 1, "top_k": 0, "min_p": 0,
            "repetition_penalty": 1}  # fmt: skip
    s = apply_sampling_defaults(parse_chat_request(body).sampling, defaults)
    assert (s.temperature, s.top_p, s.top_k, s.min_p, s.repetition_penalty) == (
        1.0, 1.0, 0, 0.0, 1.0)  # fmt: skip
    # null is absent, as OpenAI reads it.
    s = apply_sampling_defaults(parse_chat_request({**CHAT, "temperature": None}).sampling,
                                defaults)  # fmt: skip
    assert s.temperature == 0.2


def test_operator_defaults_win_and_generation_config_none_drops_the_models() -> None:
    files, operator = SamplingDefaults(temperature=0.2, top_p=0.9), SamplingDefaults(top_p=0.5)
    assert model_sampling_defaults(files, operator, use_files=True) == SamplingDefaults(
        temperature=0.2, top_p=0.5
    )
    assert model_sampling_defaults(files, operator, use_files=False) == operator


# -- max_tokens: default and cap ---------------------------------------------------------------


def policy(
    default: int | None = None, limit: int | None = None, tpm: int | None = None
) -> TokenPolicy:
    return TokenPolicy(default, limit, "model 'm'", tpm, "acme")


def test_tenant_and_model_limits_merge() -> None:
    model, tenant = MaxTokensLimits(1000, 4000), MaxTokensLimits(None, 500)
    p = token_policy(model, tenant, tokens_per_minute=None, tenant_name="acme", model_name="m")
    assert (p.default_max_tokens, p.max_tokens_limit, p.limit_owner) == (500, 500, "tenant 'acme'")
    p = token_policy(model, MaxTokensLimits(64, None), tokens_per_minute=9, tenant_name="a",
                     model_name="m")  # fmt: skip
    assert (p.default_max_tokens, p.max_tokens_limit, p.limit_owner) == (64, 4000, "model 'm'")
    assert (p.tokens_per_minute, p.tenant_name) == (9, "a")


def test_the_model_files_default_yields_to_the_operators_and_obeys_its_cap() -> None:
    assert model_max_tokens(MaxTokensLimits(100, 400), 300) == MaxTokensLimits(100, 400)
    assert model_max_tokens(MaxTokensLimits(None, 400), 300) == MaxTokensLimits(300, 400)
    assert model_max_tokens(MaxTokensLimits(None, 200), 300) == MaxTokensLimits(200, 200)
    assert model_max_tokens(MaxTokensLimits(None, None), None) == MaxTokensLimits(None, None)


def test_the_reservation_floor_never_exceeds_the_planned_reservation() -> None:
    """Quotas are checked against the floor before tokenizing: what the request reserves
    once its prompts are known is never less, so the check refuses nothing that would
    have been admitted."""
    explicit = parse_completion_request({"model": "m", "prompt": ["a", "b"], "n": 3,
                                         "max_tokens": 7}).sampling  # fmt: skip
    assert reservation_floor(2, explicit, policy()) == 2 * 3 * 7
    budget = plan_tokens([4, 5], explicit, max_len=100, policy=policy(), is_chat=False)
    assert budget.reserved_tokens == 4 + 5 + 2 * 3 * 7
    defaulted = parse_chat_request(CHAT).sampling
    assert reservation_floor(1, defaulted, policy(50)) == 1  # a default may shrink to 1
    assert reservation_floor(1, defaulted, policy(tpm=20)) == 1
    # Past the tenant's minute or cap the floor stops there: plan_tokens' 400 explains it.
    assert reservation_floor(2, explicit, policy(tpm=30)) == 30
    assert reservation_floor(2, explicit, policy(None, 5)) == 2 * 3 * 5


def test_absent_max_tokens_gets_the_default_cut_to_the_context() -> None:
    chat = parse_chat_request(CHAT).sampling
    assert plan_tokens([10], chat, max_len=100, policy=NO_LIMITS, is_chat=True).max_tokens == (
        None,
    )  # no default: up to the context, as before
    assert plan_tokens([10], chat, max_len=100, policy=policy(50), is_chat=True).max_tokens == (50,)
    assert plan_tokens([70], chat, max_len=100, policy=policy(50), is_chat=True).max_tokens == (30,)
    # /v1/completions keeps OpenAI's 16 unless a default is configured; a cap applies to it.
    completion = parse_completion_request({"model": "m", "prompt": ["a", "b"]}).sampling
    assert plan_tokens([5, 98], completion, max_len=100, policy=NO_LIMITS,
                       is_chat=False).max_tokens == (16, 2)  # fmt: skip
    assert plan_tokens([5], completion, max_len=100, policy=policy(None, 8),
                       is_chat=False).max_tokens == (8,)  # fmt: skip


def test_explicit_max_tokens_over_the_limit_is_a_400_naming_it() -> None:
    s = parse_chat_request({**CHAT, "max_completion_tokens": 600}).sampling
    with pytest.raises(ApiError) as info:
        plan_tokens([10], s, max_len=10_000, policy=policy(None, 500), is_chat=True)
    assert (info.value.status, info.value.param) == (400, "max_tokens")
    assert "600 is more than the limit of 500 tokens set for model 'm'" in info.value.message
    # At the limit is fine; an explicit value over the context is still the context's 400.
    ok = parse_chat_request({**CHAT, "max_tokens": 500}).sampling
    assert plan_tokens([10], ok, max_len=10_000, policy=policy(None, 500),
                       is_chat=True).max_tokens == (500,)  # fmt: skip
    with pytest.raises(ApiError, match="maximum context length is 100"):
        plan_tokens([10], ok, max_len=100, policy=NO_LIMITS, is_chat=True)


def test_min_tokens_is_checked_against_the_default() -> None:
    s = parse_completion_request({"model": "m", "prompt": "a", "min_tokens": 17}).sampling
    with pytest.raises(ApiError, match=r"more than max_tokens \(16, the default\)"):
        plan_tokens([3], s, max_len=100, policy=NO_LIMITS, is_chat=False)
    assert plan_tokens([3], s, max_len=100, policy=policy(20), is_chat=False).max_tokens == (20,)


# -- prompt arrays and n against the tenant's tokens per minute --------------------------------


def test_reservation_is_prompts_plus_every_choices_max_tokens() -> None:
    s = parse_completion_request({"model": "m", "prompt": ["a", "b", "c"], "n": 2,
                                  "max_tokens": 10}).sampling  # fmt: skip
    budget = plan_tokens([4, 5, 6], s, max_len=100, policy=policy(tpm=75), is_chat=False)
    assert (budget.max_tokens, budget.reserved_tokens) == ((10, 10, 10), 15 + 3 * 2 * 10)
    with pytest.raises(ApiError) as info:  # 75 needed, 74 a minute: never
        plan_tokens([4, 5, 6], s, max_len=100, policy=policy(tpm=74), is_chat=False)
    assert (info.value.status, info.value.param, info.value.code) == (
        400, "n", "tokens_per_minute_exceeded")  # fmt: skip
    assert "limit 74, requested 75" in info.value.message


def test_never_fitting_requests_name_the_parameter_to_lower() -> None:
    one = parse_chat_request({**CHAT, "max_tokens": 100}).sampling
    with pytest.raises(ApiError) as info:
        plan_tokens([10], one, max_len=1000, policy=policy(tpm=50), is_chat=True)
    assert info.value.param == "max_tokens"
    with pytest.raises(ApiError) as info:
        plan_tokens([60], parse_chat_request(CHAT).sampling, max_len=1000,
                    policy=policy(tpm=50), is_chat=True)  # fmt: skip
    assert info.value.param == "messages"


def test_a_default_shrinks_to_what_the_tenant_can_spend_in_a_minute() -> None:
    s = parse_chat_request({**CHAT, "n": 3}).sampling
    # No default: the context (1000 - 10 per choice) would never fit 100 a minute.
    budget = plan_tokens([10], s, max_len=1000, policy=policy(tpm=100), is_chat=True)
    assert (budget.max_tokens, budget.reserved_tokens) == ((30,), 100)
    budget = plan_tokens([10], s, max_len=1000, policy=policy(8, tpm=100), is_chat=True)
    assert (budget.max_tokens, budget.reserved_tokens) == ((8,), 34)


# -- the quota store holds the reservation and gives back the rest -----------------------------


def test_memory_store_requires_the_whole_reservation_and_refunds_the_unused() -> None:
    now = [1_000_000.0]
    store = MemoryQuotaStore(lambda: now[0])
    t = Tenant("t", None, 0, Quotas(tokens_per_minute=600), cache_salt="t")

    async def run() -> None:
        assert (
            await store.admit(t, lease_id="a", prompt_tokens=100, reserved_tokens=500)
        ).is_admitted
        refused = await store.admit(t, lease_id="b", prompt_tokens=10, reserved_tokens=200)
        # 100 left, 200 needed: 100 missing at 10 a second.
        assert (refused.limit, refused.retry_after_s) == ("tokens_per_minute", pytest.approx(10))
        # "a" generated 50 of its 400: 350 come back.
        await store.finish(t, lease_id="a", prompt_tokens=100, completion_tokens=50,
                           reserved_tokens=500)  # fmt: skip
        assert (
            await store.admit(t, lease_id="c", prompt_tokens=10, reserved_tokens=450)
        ).is_admitted
        # A refund never fills the bucket past its capacity: a minute later the bucket is
        # full again (600), and c's unused 440 cannot take it to 1040.
        now[0] += 60
        await store.finish(t, lease_id="c", prompt_tokens=10, completion_tokens=0,
                           reserved_tokens=450)  # fmt: skip
        assert (
            await store.admit(t, lease_id="d", prompt_tokens=1, reserved_tokens=600)
        ).is_admitted
        refused = await store.admit(t, lease_id="e", prompt_tokens=1, reserved_tokens=1)
        assert (refused.limit, refused.retry_after_s) == ("tokens_per_minute", pytest.approx(0.1))

    asyncio.run(run())


# -- configuration -----------------------------------------------------------------------------


def test_config_limits_sampling_and_tenant_fields() -> None:
    key = hash_api_key("sk-1")
    config = parse_config({
        "limits": {"default_max_tokens": 256, "max_tokens_limit": 1024},
        "sampling": {"generation_config": "none", "defaults": {"temperature": 0.5, "top_k": 40}},
        "tenants": [{"name": "a", "api_key_sha256": key, "max_tokens_limit": 64}],
    })  # fmt: skip
    assert config.max_tokens == MaxTokensLimits(256, 1024)
    assert (config.use_generation_config, config.sampling_defaults) == (
        False, SamplingDefaults(temperature=0.5, top_k=40))  # fmt: skip
    assert config.tenants.tenants["a"].max_tokens == MaxTokensLimits(None, 64)
    assert parse_config({}).use_generation_config
    for raw, fragment in [
        ({"limits": {"max_tokens_limit": 0}}, "limits.max_tokens_limit must be a positive"),
        ({"limits": {"default_max_tokens": 9, "max_tokens_limit": 8}}, "is more than"),
        ({"sampling": {"generation_config": "vllm"}}, "auto or none"),
        ({"sampling": {"defaults": {"temperature": 3}}}, r"in \[0, 2\]"),
        ({"sampling": {"defaults": {"temperature": float("nan")}}}, r"in \[0, 2\]"),
        # every request without a top_p would get one the worker refuses
        ({"sampling": {"defaults": {"top_p": 0}}}, r"top_p must be in \(0, 1\]"),
        ({"sampling": {"defaults": {"seed": 3}}}, "unknown fields"),
    ]:
        with pytest.raises(ConfigError, match=fragment):
            parse_config(raw)
    with pytest.raises(TenantConfigError, match=r"tenants\[0\].default_max_tokens"):
        parse_tenants([{"name": "a", "api_key_sha256": key, "default_max_tokens": "lots"}])


def test_null_content_is_valid_only_for_an_assistant_message_with_tool_calls() -> None:
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    body = {"model": "m", "messages": [
        {"role": "user", "content": "x"},
        {"role": "assistant", "content": None, "tool_calls": [call]},
        {"role": "tool", "tool_call_id": "c1", "content": "42"},
    ]}  # fmt: skip
    assert parse_chat_request(body).messages[1].content == ""
    body["messages"][1] = {"role": "assistant", "content": None}
    with pytest.raises(ApiError) as info:
        parse_chat_request(body)
    assert (info.value.status, info.value.param) == (400, "messages[1].content")
