"""The model cascade, pure: the `cascade:` config and its errors, and the checks that keep
a small model's answer or send the request up to the large model (no network)."""

from __future__ import annotations

import re
from typing import Any

import pytest

from kvflow.router.cascade.checks import SmallChoice, escalation, is_valid_json, mean_logprob
from kvflow.router.cascade.config import CascadeChecks
from kvflow.router.cascade.service import Cascade, header, outcome
from kvflow.router.config_fields import ConfigError
from kvflow.router.settings import parse_config
from kvflow.router.tenants.config import ANONYMOUS, Quotas, Tenant

POOLS = [
    {"name": "big", "served_model_name": "big-v1", "workers": ["127.0.0.1:1"]},
    {"name": "small", "served_model_name": "small-v1", "workers": ["127.0.0.1:2"]},
]
MODELS = [
    {"name": "chat", "aliases": ["assistant"], "targets": [{"pool": "big"}]},
    {"name": "large", "targets": [{"pool": "big"}]},
    {"name": "small", "targets": [{"pool": "small"}]},
]
CHECKS = CascadeChecks(min_mean_logprob=-1.0, refusal_patterns=(re.compile(r"(?i)I can't"),))


def config(cascade: Any, pools: Any = POOLS, models: Any = MODELS) -> dict[str, Any]:
    out: dict[str, Any] = {"cascade": cascade}
    if pools is not None:
        out |= {"pools": pools, "models": models}
    return out


def test_a_cascade_parses_with_its_aliases_and_checks() -> None:
    checks = {"min_mean_logprob": -1.5, "refusal_patterns": ["(?i)sorry"]}
    raw = config({"chat": {"small": "small", "large": "large", "checks": checks}})
    spec = parse_config(raw).cascade["chat"]
    assert (spec.small, spec.large, spec.names) == (
        "small",
        "large",
        frozenset({"chat", "assistant"}),
    )
    assert spec.checks.min_mean_logprob == -1.5
    assert spec.checks.json_when_response_format  # on unless turned off
    assert [p.pattern for p in spec.checks.refusal_patterns] == ["(?i)sorry"]
    # A pool's served name is a target too.
    assert parse_config(config({"chat": {"small": "small-v1", "large": "big-v1"}})).cascade
    assert parse_config({}).cascade == {}  # off unless configured


@pytest.mark.parametrize(
    ("cascade", "pools", "words"),
    [
        ({"chat": {"small": "small", "large": "nope"}}, POOLS, "large 'nope' is not a model"),
        ({"chat": {"small": "tiny", "large": "large"}}, POOLS, "small 'tiny' is not a model"),
        ({"chat": {"large": "large"}}, POOLS, "cascade.chat.small is required"),
        ({"chat": {"small": "small", "large": "small"}}, POOLS, "both 'small'"),
        ({"chat": {"small": "assistant", "large": "large"}}, POOLS, "the cascade's own name"),
        ({"ghost": {"small": "small", "large": "large"}}, POOLS, "'ghost' is not a model"),
        ({"chat": {"small": "small", "large": "large"}}, None, "needs a pools section"),
        ({"chat": {"small": "small", "large": "large", "size": 1}}, POOLS, "size"),
        ({"chat": {"small": "small", "large": "large", "checks": {"min_mean_logprob": 0.5}}},
         POOLS, "min_mean_logprob must be a number <= 0"),
        ({"chat": {"small": "small", "large": "large", "checks": {"refusal_patterns": ["("]}}},
         POOLS, "refusal_patterns[0] '(' is not a valid regex"),
        ({"chat": {"small": "small", "large": "large",
                   "checks": {"json_when_response_format": "yes"}}}, POOLS, "true or false"),
        ({"chat": {"small": "small", "large": "large"},
          "assistant": {"small": "small", "large": "large"}}, POOLS, "already has a cascade"),
    ],
)  # fmt: skip
def test_a_bad_cascade_is_refused_naming_the_field(cascade: Any, pools: Any, words: str) -> None:
    with pytest.raises(ConfigError, match=re.escape(words)):
        parse_config(config(cascade, pools))


def test_a_confident_plain_answer_stays_small() -> None:
    assert escalation([SmallChoice("Paris.", (-0.1, -0.3))], CHECKS, None) is None
    assert escalation([SmallChoice("", ())], CHECKS, None) is None  # nothing to doubt


def test_a_low_mean_logprob_escalates() -> None:
    assert mean_logprob([-0.5, -2.5]) == -1.5
    assert escalation([SmallChoice("Maybe Lyon?", (-0.5, -2.5))], CHECKS, None) == "low_logprob"
    # One doubtful choice of several escalates the request.
    choices = [SmallChoice("a", (-0.1,)), SmallChoice("b", (-3.0,))]
    assert escalation(choices, CHECKS, None) == "low_logprob"
    assert escalation(choices, CascadeChecks(), None) is None  # no threshold: check off


def test_invalid_json_escalates_only_when_json_was_asked_for() -> None:
    assert is_valid_json('{"a": 1}', "json_object")
    assert not is_valid_json("[1, 2]", "json_object")  # json_object: an object
    assert is_valid_json("[1, 2]", "json_schema")
    cut = SmallChoice('{"city": "Par', (-0.1,))
    assert escalation([cut], CHECKS, "json_schema") == "invalid_json"
    assert escalation([cut], CHECKS, None) is None  # plain text may be anything
    assert escalation([cut], CHECKS, "regex") is None
    off = CascadeChecks(json_when_response_format=False)
    assert escalation([cut], off, "json_object") is None


def test_a_refusal_escalates_before_the_other_checks() -> None:
    refusal = SmallChoice("Sorry, I CAN'T help with that.", (-0.1,))
    assert escalation([refusal], CHECKS, "json_object") == "refusal"


def test_the_header_and_outcome_name_the_reason() -> None:
    assert (header(None), outcome(None)) == ("small", "answered_small")
    assert (header("refusal"), outcome("refusal")) == ("escalated:refusal", "escalated_refusal")


def test_a_tenant_allowed_only_the_cascade_name_gets_no_cascade() -> None:
    specs = parse_config(config({"chat": {"small": "small", "large": "large"}})).cascade
    cascade = Cascade(specs)
    assert cascade.plan("assistant", ANONYMOUS) is specs["chat"]
    assert cascade.plan("large", ANONYMOUS) is None
    narrow = Tenant("acme", frozenset({"chat", "large"}), 0, Quotas(), cache_salt="")
    assert cascade.plan("chat", narrow) is None  # never a model it may not use
