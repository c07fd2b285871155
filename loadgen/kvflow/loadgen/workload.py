"""The records every workload produces: requests as named blocks of words, and the protocol.

A request does not hold its text: it holds *which* blocks of content it is made of
(``TextBlock`` keys) and their lengths; ``text.block_word_ids`` makes the words on demand.
A Mooncake trace at full length is 4,000 prompts of 15,000 tokens (60 M tokens): as lists
of ints that is about 500 MB, as block names a few MB. It also makes sharing explicit: two
requests share a prefix exactly when their leading blocks have the same keys.

Workloads are pure and seeded: the same seed and namespace give the same requests. The
namespace changes the content (not the shape) so that one run of a QPS ladder does not
warm the server's cache for the next.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from kvflow.loadgen.text import block_word_ids, render_text

ROLES = ("system", "user", "assistant")


@dataclass(frozen=True, slots=True)
class TextBlock:
    key: str  # content identity: equal keys (in one namespace) render equal words
    num_words: int


@dataclass(frozen=True, slots=True)
class Segment:
    """One chat message; a completions prompt is the segments' words joined."""

    role: str
    blocks: tuple[TextBlock, ...]

    @property
    def num_words(self) -> int:
        return sum(b.num_words for b in self.blocks)


@dataclass(frozen=True, slots=True)
class BenchRequest:
    request_id: str
    # Seeds the content of the blocks: seed and ladder rung (``content_namespace``).
    namespace: str
    # Requests of one session (a user, a conversation) go to one closed-loop user in order;
    # a router's session affinity may key on it.
    session_id: str
    segments: tuple[Segment, ...]
    num_output_tokens: int
    # When it arrives, from a trace (seconds from the trace's start); None: the arrival
    # process decides.
    trace_offset_s: float | None = None

    @property
    def num_prompt_words(self) -> int:
        return sum(s.num_words for s in self.segments)

    def blocks(self) -> Iterator[TextBlock]:
        for segment in self.segments:
            yield from segment.blocks


def scaled(length: int, scale: float) -> int:
    """A length times a scale, at least 1: scaled-down runs keep every request non-empty."""
    return max(1, round(length * scale))


def content_namespace(seed: int, namespace: str) -> str:
    return f"{seed}/{namespace}"


def segment_word_ids(namespace: str, segment: Segment) -> list[int]:
    words: list[int] = []
    for block in segment.blocks:
        words += block_word_ids(namespace, block.key, block.num_words)
    return words


def segment_text(namespace: str, segment: Segment) -> str:
    return render_text(segment_word_ids(namespace, segment))


def prompt_word_ids(request: BenchRequest) -> list[int]:
    """The whole prompt as word ids (a completions prompt, or tokens for a simulator)."""
    words: list[int] = []
    for segment in request.segments:
        words += segment_word_ids(request.namespace, segment)
    return words


class Workload(Protocol):
    """A seeded request generator: pure (no I/O, no clock) and deterministic."""

    @property
    def name(self) -> str:
        """What reports call it: ``shared-prefix``, ``trace``..."""
        ...

    def requests(self, *, seed: int, namespace: str) -> Iterator[BenchRequest]:
        """Requests in arrival order: unbounded for synthetic workloads, a trace's length
        for a trace. The same seed and namespace give the same sequence."""
        ...
