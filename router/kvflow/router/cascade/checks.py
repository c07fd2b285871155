"""Whether a small model's answer is sent as it is, or escalated to the large model (pure).

Each choice is checked on its own; the first failing check of the first failing choice names
the escalation (a request with n choices escalates whole: the client gets one model's
answer). The checks, cheapest first:

- refusal: the text matches one of the configured patterns (`re.search`);
- invalid_json: the request asked for JSON (response_format json_object / json_schema) and
  the text does not parse (json_object: not an object). Conformance to the schema is the
  grammar's job on the worker; a cut-off answer (max_tokens) is what fails here;
- low_logprob: the mean logprob of the choice's tokens is under the threshold. A choice
  without logprobs (no tokens) passes: there is nothing to doubt.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Literal

from kvflow.router.cascade.config import CascadeChecks

Reason = Literal["refusal", "invalid_json", "low_logprob", "small_error"]
REASONS: tuple[Reason, ...] = ("refusal", "invalid_json", "low_logprob", "small_error")
JSON_KINDS = frozenset({"json_object", "json_schema"})


@dataclass(frozen=True)
class SmallChoice:
    """One choice of the small model's answer, as the checks see it."""

    text: str
    logprobs: tuple[float, ...] = ()


def mean_logprob(logprobs: Sequence[float]) -> float | None:
    return sum(logprobs) / len(logprobs) if logprobs else None


def is_valid_json(text: str, kind: str) -> bool:
    try:
        value = json.loads(text)
    except ValueError:
        return False
    return kind != "json_object" or isinstance(value, dict)


def choice_reason(
    choice: SmallChoice, checks: CascadeChecks, json_kind: str | None
) -> Reason | None:
    if any(p.search(choice.text) for p in checks.refusal_patterns):
        return "refusal"
    wants_json = checks.json_when_response_format and json_kind in JSON_KINDS
    if wants_json and json_kind is not None and not is_valid_json(choice.text, json_kind):
        return "invalid_json"
    mean = mean_logprob(choice.logprobs)
    threshold = checks.min_mean_logprob
    if threshold is not None and mean is not None and mean < threshold:
        return "low_logprob"
    return None


def escalation(
    choices: Sequence[SmallChoice], checks: CascadeChecks, json_kind: str | None
) -> Reason | None:
    """Why the answer goes to the large model; None: the small answer is sent."""
    for choice in choices:
        reason = choice_reason(choice, checks, json_kind)
        if reason is not None:
            return reason
    return None
