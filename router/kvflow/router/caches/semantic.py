"""The semantic cache's pure core (docs/router.md, "Semantic cache"): what text of a request
is embedded, what else must be equal for two requests to share an answer (the scope), and
the nearest stored entry by cosine similarity. No I/O.

Only the last user message is compared by meaning. Everything else that decides the answer
(the system prompt, the earlier turns, tools, response format, sampling after the defaults,
the model and prompt template versions, the tenant and its user) must be exactly equal: it
is digested into the scope, as the exact cache digests it into its key (caches/key.py).
Comparing the whole conversation by meaning would let one long shared history drown a
different last question.
"""

from __future__ import annotations

import dataclasses
import math
import re
from collections.abc import Sequence
from dataclasses import dataclass

from kvflow.router.caches.key import (
    ModelVersion,
    TenantScope,
    request_fingerprint,
    scoped_key,
    store_prefix,
)
from kvflow.router.protocol.requests import ChatRequest, CompletionRequest, SamplingOptions

# Bumped when an entry's format or the scope's fields change: older entries never match.
SEMANTIC_FORMAT = "s1"


@dataclass(frozen=True)
class Query:
    """A request as the semantic cache sees it: the text compared by meaning, and the
    digest of everything else (``context``)."""

    text: str
    context: str


def query_of(parsed: ChatRequest | CompletionRequest, sampling: SamplingOptions) -> Query | None:
    """None for a request the semantic cache does not compare: a completion (its prompt is
    not a question), or a chat whose last message is not a user's non-empty text."""
    if not isinstance(parsed, ChatRequest) or not parsed.messages:
        return None
    last = parsed.messages[-1]
    if last.role != "user" or not last.content.strip():
        return None
    # The last message without its text: its role and name still have to be equal.
    blank = dataclasses.replace(last, content="")
    rest = dataclasses.replace(parsed, messages=(*parsed.messages[:-1], blank))
    return Query(last.content, request_fingerprint(rest, sampling))


def scope_key(namespace: str, scope: TenantScope, version: ModelVersion, context: str) -> str:
    """The store's key of one scope's entries: the pool and tenant readable (a purge selects
    by them, as the exact cache's keys: caches/key.py), the rest digested."""
    return scoped_key("scache", SEMANTIC_FORMAT, namespace, scope, version, context)


def scope_prefix(namespace: str, pool: str | None = None, tenant: str | None = None) -> str:
    """Scopes under a pool and tenant; None stops the prefix there (a purge's selection)."""
    return store_prefix("scache", namespace, pool, tenant)


def cosine(a: Sequence[float], b: Sequence[float]) -> float:
    """Cosine similarity; 0 for vectors of different lengths or a zero vector (never a
    match: a vector from another model or dimension count is not comparable)."""
    if len(a) != len(b) or not a:
        return 0.0
    dot = math.fsum(x * y for x, y in zip(a, b, strict=True))
    norm = math.sqrt(math.fsum(x * x for x in a)) * math.sqrt(math.fsum(y * y for y in b))
    return 0.0 if norm == 0 else dot / norm


_NUMBER = re.compile(r"\d+(?:[.,]\d+)*")


def numbers_in(text: str) -> tuple[str, ...]:
    """The numbers written in ``text``, in order. Two texts with different numbers never
    match: the embedding model barely tells "5 miles" from "50 miles" (docs/benchmarks.md,
    "Semantic cache quality"), and a wrong number is a wrong answer."""
    return tuple(_NUMBER.findall(text))


@dataclass(frozen=True)
class Candidate:
    vector: Sequence[float]
    numbers: tuple[str, ...]


@dataclass(frozen=True)
class Match:
    index: int
    similarity: float


def nearest(query: Candidate, candidates: Sequence[Candidate], threshold: float) -> Match | None:
    """The most similar of ``candidates`` with the query's numbers, if its similarity
    reaches ``threshold``; else None. A linear scan: a scope holds at most the configured
    number of entries."""
    best: Match | None = None
    for i, candidate in enumerate(candidates):
        if candidate.numbers != query.numbers:
            continue
        similarity = cosine(query.vector, candidate.vector)
        if best is None or similarity > best.similarity:
            best = Match(i, similarity)
    if best is None or best.similarity < threshold:
        return None
    return best
