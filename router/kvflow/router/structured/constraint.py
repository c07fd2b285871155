"""What the output must look like: one typed record, checked before any worker sees it.

The workers compile the same formats against their vocabulary (llguidance, see
docs/router.md, "Structured output"); the gateway compiles them once without a
vocabulary, so a schema or grammar the compiler rejects is a 400 naming the problem
instead of a failed worker call. Checked formats are remembered, bounded by their bytes
(a count bound lets 1024 schemas of 8 MB each stay), because agents send the same schema
with every request.

Compiling is CPU work of unbounded length for a hostile grammar: it runs on the gateway's
prepare threads with a time limit (serving/prepare.py), never on the event loop, and under
explicit llguidance limits (COMPILE_LIMITS), the same as the workers'.
"""

from __future__ import annotations

import json
import threading
from collections import OrderedDict
from dataclasses import dataclass, field
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
    # The request parameter it came from, for error messages; not part of its identity.
    param: str = field(default="", compare=False)

    @staticmethod
    def json_schema(schema: Any, *, param: str = "") -> OutputConstraint:
        return OutputConstraint("json_schema", json.dumps(schema, separators=(",", ":")), param)


# llguidance's limits, set here rather than left to the library's defaults (which may move
# between releases), and the same in the workers (engine_worker structured/grammar.py).
# Fuel is llguidance's unit of lexer work (~50k per ms building, ~14k per ms per step), so
# a compile's lexer work stays near 20 ms and a step's near 15 ms; lexer states cost 1-2 kB
# each, so 100,000 bound one grammar's lexer near 200 MB (the library's 250,000: 500 MB).
COMPILE_LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=500_000,
)
# Remembered verdicts, by the bytes of their sources: 32 MiB holds ~1000 typical schemas.
DEFAULT_CACHE_BYTES = 32 * 1024 * 1024


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


def _compile_problem(constraint: OutputConstraint) -> str:
    try:
        grammar = _grammar(constraint)
    except ValueError as err:
        return str(err)
    message = llguidance.LLMatcher.validate_grammar(grammar, limits=COMPILE_LIMITS)
    return "" if message.startswith("WARNING") else message


class VerdictCache:
    """Least recently used compile verdicts, bounded by the bytes of the sources they
    hold. Thread-safe (the prepare threads share it)."""

    def __init__(self, max_bytes: int = DEFAULT_CACHE_BYTES) -> None:
        self.max_bytes = max_bytes
        self.num_bytes = 0
        self._entries: OrderedDict[OutputConstraint, str] = OrderedDict()
        self._lock = threading.Lock()

    @staticmethod
    def _size(constraint: OutputConstraint, problem: str) -> int:
        return len(constraint.source) + len(problem) + 64  # 64: the entry's own overhead

    def get(self, constraint: OutputConstraint) -> str | None:
        with self._lock:
            problem = self._entries.get(constraint)
            if problem is not None:
                self._entries.move_to_end(constraint)
            return problem

    def put(self, constraint: OutputConstraint, problem: str) -> None:
        size = self._size(constraint, problem)
        if size > self.max_bytes:
            return  # larger than the whole cache: compiled again next time
        with self._lock:
            old = self._entries.pop(constraint, None)
            if old is not None:
                self.num_bytes -= self._size(constraint, old)
            self._entries[constraint] = problem
            self.num_bytes += size
            while self.num_bytes > self.max_bytes:
                evicted, evicted_problem = self._entries.popitem(last=False)
                self.num_bytes -= self._size(evicted, evicted_problem)

    def __len__(self) -> int:
        return len(self._entries)


VERDICTS = VerdictCache()


def _problem(constraint: OutputConstraint) -> str:
    problem = VERDICTS.get(constraint)
    if problem is None:
        problem = _compile_problem(constraint)
        VERDICTS.put(constraint, problem)
    return problem


def check_constraint(constraint: OutputConstraint, param: str | None = None) -> OutputConstraint:
    """``constraint`` if it compiles; else a 400 naming ``param`` (default: the one it came
    from) and the compiler's words. CPU work: call it off the event loop."""
    problem = _problem(constraint)
    if problem:
        raise constraint_error(param or constraint.param or "response_format", problem)
    return constraint


def constraint_error(param: str, problem: str) -> ApiError:
    # The compiler's messages span lines (a caret under the regex): one line, bounded.
    words = " ".join(problem.split())[:400]
    return invalid_request(
        f"Invalid '{param}': the grammar compiler rejected it: {words}",
        param=param,
        code="invalid_schema" if "schema" in param or "parameters" in param else "invalid_value",
    )
