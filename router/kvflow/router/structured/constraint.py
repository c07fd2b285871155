"""What the output must look like: one typed record, checked before any worker sees it.

The workers compile the same formats against their vocabulary (llguidance, see
docs/router.md, "Structured output"); the gateway compiles them once without a
vocabulary, so a schema or grammar the compiler rejects is a 400 naming the problem
instead of a failed worker call. Checked formats are remembered (bounded) because agents
send the same schema with every request.
"""

from __future__ import annotations

import functools
import json
from dataclasses import dataclass
from typing import Any, Literal

import llguidance

from kvflow.router.protocol.errors import ApiError, invalid_request

ConstraintKind = Literal["json_schema", "json_object", "regex", "lark", "ebnf"]

# Mirrors the worker's JSON options (compact, no free whitespace) so that the check here
# is the compile there.
_JSON_OPTIONS: Any = {"whitespace_flexible": False, "item_separator": ", ", "key_separator": ": "}


@dataclass(frozen=True)
class OutputConstraint:
    """A format for the whole output. ``source``: the schema as JSON text, the regex, the
    grammar; empty for ``json_object``. ``ebnf`` takes GBNF or Lark (llguidance tells
    them apart)."""

    kind: ConstraintKind
    source: str = ""

    @staticmethod
    def json_schema(schema: Any) -> OutputConstraint:
        return OutputConstraint("json_schema", json.dumps(schema, separators=(",", ":")))


def _grammar(constraint: OutputConstraint) -> str:
    if constraint.kind == "json_schema":
        return llguidance.LLMatcher.grammar_from_json_schema(constraint.source, _JSON_OPTIONS)
    if constraint.kind == "json_object":
        return llguidance.LLMatcher.grammar_from_json_schema('{"type":"object"}', _JSON_OPTIONS)
    if constraint.kind == "regex":
        return llguidance.LLMatcher.grammar_from_regex(constraint.source)
    if constraint.kind == "lark":
        return llguidance.LLMatcher.grammar_from_lark(constraint.source)
    return llguidance.grammar_from("grammar", constraint.source)


@functools.lru_cache(maxsize=1024)  # ~1 ms per small schema saved on every repeat
def _problem(constraint: OutputConstraint) -> str:
    try:
        grammar = _grammar(constraint)
    except ValueError as err:
        return str(err)
    message = llguidance.LLMatcher.validate_grammar(grammar)
    return "" if message.startswith("WARNING") else message


def check_constraint(constraint: OutputConstraint, param: str) -> OutputConstraint:
    """``constraint`` if it compiles; else a 400 naming ``param`` and the compiler's words."""
    problem = _problem(constraint)
    if problem:
        raise constraint_error(param, problem)
    return constraint


def constraint_error(param: str, problem: str) -> ApiError:
    # The compiler's messages span lines (a caret under the regex): one line, bounded.
    words = " ".join(problem.split())[:400]
    return invalid_request(
        f"Invalid '{param}': the grammar compiler rejected it: {words}",
        param=param,
        code="invalid_schema" if "schema" in param or "parameters" in param else "invalid_value",
    )
