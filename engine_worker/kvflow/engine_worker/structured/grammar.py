"""Compile a requested format into a grammar matcher, once per format, with llguidance.

Why llguidance (PyPI ``llguidance``) and not xgrammar: one 3 MB wheel with no Python
dependencies (xgrammar pulls transformers and a TVM runtime into the worker image), it
takes a vocabulary as plain bytes per token id (the worker has no ``transformers``
tokenizer), it reads JSON Schema, regular expressions, Lark and GBNF natively, its mask
for a typical step costs tens of microseconds on one CPU core (docs/benchmarks.md,
"Structured output"), and a bad format is an error *message*, not an exception from deep
inside, which maps straight to INVALID_ARGUMENT.

Compiling is the expensive part (building the lexer and parser tables: ~1 ms for a small
JSON schema, 100 ms and more for large grammars), and agents send the same schema again
and again, so a compiled matcher is kept per format in an LRU bounded by bytes
(``--grammar-cache-mib``) and each request gets a ``deep_copy`` of it (~40 us). The
tokenizer is fixed per worker, so the format alone is the key.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

import llguidance

from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.structured.byte_lru import ByteLru
from kvflow.engine_worker.structured.vocabulary import Vocabulary

if TYPE_CHECKING:
    from llguidance._lib import JsonCompileOptions

GrammarKind = Literal["json_schema", "json_object", "regex", "lark", "ebnf"]

#: Memory for compiled formats (--grammar-cache-mib): at the estimate below a typical tool's
#: schema (5-20 properties) counts ~60-100 KiB, so 64 MiB keeps several hundred formats,
#: the tools and schemas of many agents at once.
DEFAULT_CACHE_MIB = 64
#: llguidance does not say how much memory a compiled matcher holds, so an entry counts an
#: estimate: a base plus so many bytes per byte of its llguidance grammar text, plus its
#: source. Measured with SmolLM2's 49,152-token vocabulary (the process's resident memory
#: per compile, averaged over 10-60 distinct schemas): 10-150 KiB for schemas of 5-100
#: properties (0.3-3 KiB of grammar text: 15-75 bytes per byte), 1.4 MiB for 400 properties
#: (11 KiB of text: 130 per byte). 100 per byte over a 32 KiB base errs high for the common
#: sizes and near the truth for large grammars, which are the ones a count bound let pile up.
BASE_ENTRY_BYTES = 32 * 1024
BYTES_PER_GRAMMAR_BYTE = 100


def entry_bytes(spec: GrammarSpec, text: str) -> int:
    """What a compiled ``spec`` counts against the cache (its llguidance grammar ``text``)."""
    return BASE_ENTRY_BYTES + BYTES_PER_GRAMMAR_BYTE * len(text) + len(spec.source)


#: JSON is written compactly, one space after ":" and ",", never free whitespace: llguidance's
#: default allows any run of whitespace between tokens, and a small or random model then
#: fills max_tokens with newlines (seen: 300 tokens of whitespace for a 4-field object).
#: A schema's own "x-guidance" options override these.
JSON_OPTIONS: JsonCompileOptions = {
    "whitespace_flexible": False,
    "item_separator": ", ",
    "key_separator": ": ",
}

#: llguidance's limits, explicit rather than the library's defaults (which may move between
#: releases), and the same as the gateway's check (router structured/constraint.py). Fuel
#: is lexer work (~50k per ms building, ~14k per ms per step): a compile's lexer work
#: stays near 20 ms and a mask step's near 15 ms; lexer states cost 1-2 kB each, so
#: 100,000 bound one grammar's lexer near 200 MB (the library's 250,000: 500 MB).
COMPILE_LIMITS = llguidance.LLParserLimits(
    max_items_in_row=2000,
    initial_lexer_fuel=1_000_000,
    step_lexer_fuel=200_000,
    step_max_items=50_000,
    max_lexer_states=100_000,
    max_grammar_size=500_000,
)


@dataclass(frozen=True, slots=True)
class GrammarSpec:
    """A requested format, as the request carries it (``source`` is empty for
    ``json_object``)."""

    kind: GrammarKind
    source: str = ""


def grammar_text(spec: GrammarSpec) -> str:
    """The llguidance grammar for ``spec``; raises InvalidRequestError for bad input."""
    try:
        if spec.kind == "json_schema":
            return llguidance.LLMatcher.grammar_from_json_schema(spec.source, JSON_OPTIONS)
        if spec.kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema('{"type": "object"}', JSON_OPTIONS)
        if spec.kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(spec.source)
        if spec.kind == "lark":
            return llguidance.LLMatcher.grammar_from_lark(spec.source)
        return llguidance.grammar_from("ebnf", spec.source)
    except ValueError as err:  # not JSON, or a GBNF grammar that does not convert
        raise InvalidRequestError(f"invalid {spec.kind}: {err}") from err


def make_tokenizer(vocab: Vocabulary, vocab_size: int) -> llguidance.LLTokenizer:
    """llguidance's view of the tokenizer; ``vocab_size`` is the model's logits width (often
    padded past the tokenizer's last id: those ids are never allowed)."""
    eos = list(vocab.eos_token_ids)
    if vocab.tokenizer_json is not None:
        return llguidance.LLTokenizer(vocab.tokenizer_json, n_vocab=vocab_size, eos_token=eos)
    wrapper = _BytesTokenizer(vocab)
    tokenizer = llguidance.LLTokenizer(
        llguidance.TokenizerWrapper(wrapper), n_vocab=vocab_size, eos_token=eos
    )
    wrapper.tokenize = tokenizer.greedy_tokenize
    return tokenizer


class _BytesTokenizer:
    """The duck type ``llguidance.TokenizerWrapper`` wraps: bytes per id, and a tokenize
    function (longest match, set once the LLTokenizer that provides it exists)."""

    def __init__(self, vocab: Vocabulary) -> None:
        self.eos_token_id = vocab.eos_token_ids[0] if vocab.eos_token_ids else 0
        self.bos_token_id = None
        self.tokens = list(vocab.token_bytes)
        self.special_token_ids = sorted(vocab.special_token_ids)
        self.tokenize: Callable[[str], list[int]] | None = None

    def __call__(self, text: str | bytes) -> list[int]:
        assert self.tokenize is not None
        return list(self.tokenize(text.decode() if isinstance(text, bytes) else text))


class GrammarCompiler:
    """Formats -> fresh matchers, compiled once per format (thread-safe; called from the
    gRPC handlers' executor, never on the engine thread)."""

    def __init__(
        self,
        vocab: Vocabulary,
        vocab_size: int,
        *,
        cache_bytes: int = DEFAULT_CACHE_MIB * 1024 * 1024,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = vocab.eos_token_ids
        self._tokenizer = make_tokenizer(vocab, vocab_size)
        self.cache: ByteLru[GrammarSpec, llguidance.LLMatcher] = ByteLru(cache_bytes)
        self.num_compiled = 0  # cache misses, for tests and metrics
        self._count_lock = threading.Lock()

    def matcher(self, spec: GrammarSpec) -> llguidance.LLMatcher:
        """A matcher at the start of ``spec``'s grammar; raises InvalidRequestError naming
        what the compiler rejected."""
        compiled = self.cache.get(spec)
        if compiled is not None:
            return compiled.deep_copy()
        # Outside any lock: other formats need not wait (two threads compiling the same new
        # format both compile it; the second entry replaces the first).
        compiled, num_bytes = self._compile(spec)
        self.cache.put(spec, compiled, num_bytes)
        with self._count_lock:
            self.num_compiled += 1
        return compiled.deep_copy()

    def _compile(self, spec: GrammarSpec) -> tuple[llguidance.LLMatcher, int]:
        """The matcher and its estimated size (entry_bytes)."""
        text = grammar_text(spec)
        limits = COMPILE_LIMITS
        problem = llguidance.LLMatcher.validate_grammar(text, self._tokenizer, limits=limits)
        if problem and not problem.startswith("WARNING"):
            raise InvalidRequestError(f"invalid {spec.kind}: {problem}")
        matcher = llguidance.LLMatcher(self._tokenizer, text, log_level=0, limits=limits)
        if matcher.is_error():
            raise InvalidRequestError(f"invalid {spec.kind}: {matcher.get_error()}")
        return matcher, entry_bytes(spec, text)
