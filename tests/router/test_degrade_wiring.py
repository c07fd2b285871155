"""Automatic degradation, wired: the `degradation:` config and its errors, what each step
does to a request, and one model's ladder moved by its window on a clock (no network)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import yaml

from kvflow.router import cli
from kvflow.router.caches.config import ResponseCacheConfig
from kvflow.router.config_fields import ConfigError
from kvflow.router.degrade.ladder import Step
from kvflow.router.degrade.request import cap_budget, cap_request, drop_extras
from kvflow.router.degrade.service import Degradation
from kvflow.router.protocol.errors import ApiError, rate_limited
from kvflow.router.protocol.requests import parse_chat_request, parse_completion_request
from kvflow.router.serving.token_budget import TokenBudget
from kvflow.router.settings import RouterSettings, parse_config
from kvflow.router.tenants.config import ANONYMOUS, Quotas, Tenant

MESSAGES = [{"role": "user", "content": "hi"}]
TOOLS = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}}}]
POOLS = [
    {"name": "big", "served_model_name": "big-v1", "workers": ["127.0.0.1:1"]},
    {"name": "small", "served_model_name": "small-v1", "workers": ["127.0.0.1:2"]},
]
MODELS = [
    {"name": "big", "aliases": ["chat"], "targets": [{"pool": "big"}]},
    {"name": "small", "targets": [{"pool": "small"}]},
]
LADDER: dict[str, Any] = {
    "steps": ["cap_max_tokens", "drop_extras", "fallback_model"],
    "ttft_slo_s": 1.0,
    "tpot_slo_s": 0.1,
    "window_s": 10,
    "engage_after_s": 2,
    "release_after_s": 4,
    "min_requests": 3,
    "check_interval_s": 1,
    "max_tokens_cap": 64,
    "fallback_model": "small",
}


def config(**ladder: Any) -> dict[str, Any]:
    return {"pools": POOLS, "models": MODELS, "degradation": {"big": {**LADDER, **ladder}}}


def chat(**body: Any) -> Any:
    return parse_chat_request({"model": "big", "messages": MESSAGES, **body})


# --- configuration -----------------------------------------------------------------------


def test_the_section_parses_with_aliases_sharing_the_ladder() -> None:
    spec = parse_config(config()).degradation["big"]
    assert spec.names == {"big", "chat"}
    assert spec.ladder.steps == (Step.CAP_MAX_TOKENS, Step.DROP_EXTRAS, Step.FALLBACK_MODEL)
    assert (spec.targets.ttft_s, spec.max_tokens_cap, spec.fallback_model) == (1.0, 64, "small")
    assert parse_config({"pools": POOLS}).degradation == {}  # off unless configured
    assert (spec.ladder.reengage_window_s, spec.ladder.max_release_after_s) == (120, 480)
    backed = parse_config(config(reengage_window_s=0, max_release_after_s=60)).degradation
    assert (backed["big"].ladder.reengage_window_s, backed["big"].ladder.max_release_after_s) == (
        0,
        60,
    )


@pytest.mark.parametrize(
    ("ladder", "message"),
    [
        ({"steps": ["cap_max_tokens", "cap_max_tokens"]}, "twice"),
        ({"steps": ["go_faster"]}, "unknown step 'go_faster'"),
        ({"steps": []}, "non-empty list"),
        ({"max_tokens_cap": None}, "step cap_max_tokens needs degradation.big.max_tokens_cap"),
        ({"fallback_model": "nope"}, "fallback_model 'nope' is not a model this gateway serves"),
        ({"fallback_model": "chat"}, "is the model itself"),
        ({"steps": ["queue_with_deadline"]}, "needs degradation.big.queue_deadline_s"),
        ({"steps": ["queue_with_deadline"], "queue_deadline_s": 900}, "at most 300"),
        ({"ttft_slo_s": None}, "ttft_slo_s must be a number"),
        ({"release_burn": 5.0}, "hysteresis"),
        ({"slo_percentile": 100}, "slo_percentile must be in (0, 100)"),
        ({"max_tokens_cap": 0}, "max_tokens_cap must be an integer >= 1"),
        ({"typo_s": 1}, "unknown fields ['typo_s']"),
        ({"reengage_window_s": -1}, "reengage_window_s must be >= 0"),
        ({"max_release_after_s": "long"}, "max_release_after_s must be a number"),
        ({"release_offered_ratio": -0.5}, "release_offered_ratio must be >= 0"),
    ],
)
def test_config_errors_name_the_field(ladder: dict[str, Any], message: str) -> None:
    with pytest.raises(ConfigError) as info:
        parse_config(config(**ladder))
    assert message in str(info.value)


def test_the_slo_is_required_and_names_must_be_served() -> None:
    no_slo = {k: v for k, v in LADDER.items() if k != "tpot_slo_s"}
    with pytest.raises(ConfigError, match="tpot_slo_s is required"):
        parse_config({"pools": POOLS, "models": MODELS, "degradation": {"big": no_slo}})
    with pytest.raises(ConfigError, match="'bgi' is not a model this gateway serves"):
        parse_config({"pools": POOLS, "models": MODELS, "degradation": {"bgi": LADDER}})
    two = {
        "big": {**LADDER, "steps": ["drop_extras"]},
        "chat": {**LADDER, "steps": ["drop_extras"]},
    }
    with pytest.raises(ConfigError, match="already has a ladder"):
        parse_config({"pools": POOLS, "models": MODELS, "degradation": two})


def test_a_fallback_needs_pools() -> None:
    one_pool = {"degradation": {"smollm2": LADDER}}
    with pytest.raises(ConfigError, match="fallback_model needs a pools section"):
        parse_config(one_pool)
    ok = {"degradation": {"smollm2": {**LADDER, "steps": ["cap_max_tokens"]}}}
    del ok["degradation"]["smollm2"]["fallback_model"]
    assert parse_config(ok).degradation["smollm2"].names == {"smollm2"}


def test_the_response_cache_step_needs_the_response_cache_on(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """A ladder naming response_cache with the cache off would take a step that does
    nothing: refused at startup, saying how to turn the cache on."""
    raw = config(steps=["cap_max_tokens", "response_cache"])
    parsed = parse_config(raw)
    assert parsed.degradation["big"].ladder.steps[-1] is Step.RESPONSE_CACHE
    with pytest.raises(ConfigError, match="--response-cache on"):
        RouterSettings(config=parsed)
    on = RouterSettings(config=parsed, response_cache=ResponseCacheConfig(is_enabled=True))
    assert on.config.degradation["big"].ladder.steps[-1] is Step.RESPONSE_CACHE
    RouterSettings(config=parse_config(config()))  # without the step the cache may be off
    path = tmp_path / "router.yaml"
    path.write_text(yaml.safe_dump(raw))
    assert cli.main(["--config", str(path)]) == 2
    error = capsys.readouterr().err
    assert "degradation.big.steps lists response_cache, but the response cache is off" in error
    assert "turn it on with --response-cache on" in error


# --- what each step does -----------------------------------------------------------------


def test_cap_lowers_a_larger_max_tokens_and_its_min_tokens() -> None:
    capped, changed = cap_request(chat(max_tokens=500, min_tokens=100), 64)
    assert changed and (capped.sampling.max_tokens, capped.sampling.min_tokens) == (64, 64)
    small, changed = cap_request(chat(max_completion_tokens=10), 64)
    assert not changed and small.sampling.max_tokens == 10
    unset, changed = cap_request(chat(), 64)  # its default is capped in the budget
    assert not changed and unset.sampling.max_tokens is None


def test_cap_budget_caps_defaults_and_the_reservation() -> None:
    budget, changed = cap_budget(TokenBudget((None, 300), 10_000), [10, 20], n=2, cap=64)
    assert changed and budget == TokenBudget((64, 64), 10 + 20 + 2 * 128)
    same = TokenBudget((16,), 26)
    assert cap_budget(same, [10], n=1, cap=64) == (same, False)


def test_drop_extras_removes_tools_formats_and_logprobs() -> None:
    fancy = chat(tools=TOOLS, tool_choice="required", logprobs=True, top_logprobs=3)
    assert fancy.sampling.constraint is not None
    plain, changed = drop_extras(fancy)
    assert changed and plain.tools == () and plain.tool_choice.mode == "none"
    assert plain.sampling.constraint is None
    assert (plain.sampling.logprobs, plain.sampling.top_logprobs) == (False, 0)
    json_mode, changed = drop_extras(chat(response_format={"type": "json_object"}))
    assert changed and json_mode.sampling.constraint is None
    assert drop_extras(chat(max_tokens=5))[1] is False
    completion = parse_completion_request({"model": "big", "prompt": "x", "logprobs": 2})
    dropped, changed = drop_extras(completion)
    assert changed and dropped.sampling.logprobs is False


# --- the ladder on a clock ----------------------------------------------------------------


class Clock:
    def __init__(self) -> None:
        self.now_s = 0.0

    def __call__(self) -> float:
        return self.now_s


def degradation(clock: Clock, **ladder: Any) -> Degradation:
    return Degradation(parse_config(config(**ladder)).degradation, clock=clock)


def serve(d: Degradation, clock: Clock, ttft_s: float, n: int = 5, **body: Any) -> list[Any]:
    plans = []
    for _ in range(n):
        plan = d.plan(chat(**body), ANONYMOUS)
        plan.finished(ttft_s, 0.01)
        plans.append(plan)
    return plans


def test_slow_requests_climb_the_ladder_and_calm_ones_revert_it() -> None:
    clock = Clock()
    d = degradation(clock)
    moves = []
    for _ in range(8):  # hot for 8 s: a step per 2 s dwell, three in all
        serve(d, clock, ttft_s=3.0)
        clock.now_s += 1
        moves += d.check()
    assert [(t.step, t.action) for _, t in moves] == [
        (Step.CAP_MAX_TOKENS, "engaged"), (Step.DROP_EXTRAS, "engaged"),
        (Step.FALLBACK_MODEL, "engaged"),
    ]  # fmt: skip
    plan = d.plan(chat(max_tokens=500, tools=TOOLS, logprobs=True), ANONYMOUS)
    assert plan.request.model == "small" and plan.request.sampling.max_tokens == 64
    assert plan.request.tools == () and not plan.request.sampling.logprobs
    assert plan.header == "cap_max_tokens,drop_extras,fallback_model"
    # A request that no step changes says so: no header.
    assert (
        d.plan(parse_chat_request({"model": "small", "messages": MESSAGES}), ANONYMOUS).header
        is None
    )
    moves = []
    for _ in range(30):  # the window empties, the signals calm: one step back per 4 s
        clock.now_s += 1
        moves += d.check()
    assert [(t.step, t.action) for _, t in moves] == [
        (Step.FALLBACK_MODEL, "released"), (Step.DROP_EXTRAS, "released"),
        (Step.CAP_MAX_TOKENS, "released"),
    ]  # fmt: skip
    assert d.plan(chat(max_tokens=500), ANONYMOUS).header is None


def test_a_step_is_held_while_the_requests_keep_coming_and_released_when_they_ease() -> None:
    clock = Clock()
    d = degradation(
        clock, steps=["cap_max_tokens"], max_release_after_s=40, release_offered_ratio=0.9
    )
    for _ in range(3):  # hot, 5 requests a second: cap_max_tokens is taken at 2 s
        serve(d, clock, ttft_s=3.0)
        clock.now_s += 1
        d.check()
    assert d.level("big") == 1
    moves = []
    for _ in range(20):  # served on time under the cap, but asked for as often: hold
        serve(d, clock, ttft_s=0.1)
        clock.now_s += 1
        moves += d.check()
    assert moves == [] and d.level("big") == 1
    for _ in range(15):  # the requests ease to 1 a second: released
        serve(d, clock, ttft_s=0.1, n=1)
        clock.now_s += 1
        moves += d.check()
    assert [(t.step, t.action) for _, t in moves] == [(Step.CAP_MAX_TOKENS, "released")]


def test_the_response_cache_step_is_named_only_when_it_answered() -> None:
    """The step lets a sampled request take its greedy twin's stored answer (caches/);
    the response names it only when a stored answer was served."""
    degradation = Degradation(
        parse_config(config(steps=["response_cache"])).degradation, clock=lambda: 0.0
    )
    state = degradation._models["big"]
    idle = degradation.plan(chat(), ANONYMOUS)
    assert not idle.serves_sampled
    state.ladder.level = 1
    plan = degradation.plan(chat(temperature=0.7), ANONYMOUS)
    assert plan.serves_sampled and plan.header is None  # a miss: not degraded
    plan.served_from_cache()
    assert plan.header == "response_cache"
    assert not degradation.plan(parse_chat_request({"model": "small", "messages": MESSAGES}),
                                ANONYMOUS).serves_sampled  # fmt: skip


def test_a_tenant_not_allowed_the_fallback_keeps_its_model() -> None:
    clock = Clock()
    d = degradation(clock, steps=["fallback_model"], engage_after_s=0)
    serve(d, clock, ttft_s=3.0)
    clock.now_s += 1
    d.check()
    only_big = Tenant("acme", frozenset({"big"}), 0, Quotas(), cache_salt="")
    assert d.plan(chat(), only_big).request.model == "big"
    assert d.plan(chat(), ANONYMOUS).request.model == "small"


def test_capacity_refusals_count_as_late_and_quota_refusals_do_not() -> None:
    clock = Clock()
    d = degradation(clock, engage_after_s=0)
    for _ in range(5):
        d.plan(chat(), ANONYMOUS).refused(rate_limited("tenant quota", retry_after_s=1, kind="x"))
    clock.now_s += 1
    assert d.check() == []
    for _ in range(5):
        d.plan(chat(), ANONYMOUS).refused(ApiError(503, "no capacity"))
    clock.now_s += 1
    assert [t.step for _, t in d.check()] == [Step.CAP_MAX_TOKENS]


def test_a_client_that_leaves_before_the_ttft_target_says_nothing_of_the_model() -> None:
    """Hanging up at once (by design, or to push every tenant's requests down the ladder)
    is no missed first token; leaving after waiting past the target is one."""
    clock = Clock()
    d = degradation(clock, engage_after_s=0)
    ttft_target_s = config()["degradation"]["big"]["ttft_slo_s"]
    for _ in range(5):
        d.plan(chat(), ANONYMOUS).finished(None, None, left_after_s=0.5 * ttft_target_s)
    clock.now_s += 1
    assert d.check() == []
    for _ in range(5):
        d.plan(chat(), ANONYMOUS).finished(None, None, left_after_s=2 * ttft_target_s)
    clock.now_s += 1
    assert [t.step for _, t in d.check()] == [Step.CAP_MAX_TOKENS]


def test_each_request_counts_once_and_only_for_its_model() -> None:
    clock = Clock()
    d = degradation(clock, engage_after_s=0)
    plan = d.plan(chat(), ANONYMOUS)
    for _ in range(5):  # one request finishing five times is still one request
        plan.finished(9.0, 1.0)
    serve(d, clock, ttft_s=9.0, n=5, model="small")  # another model's: not big's window
    clock.now_s += 1
    assert d.check() == []  # one request: under min_requests
