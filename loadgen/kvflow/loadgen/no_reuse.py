"""The no-reuse control: every prompt is new text, so no cache can help and no router
should win or lose by its cache policy (KV-aware routing must be at parity here)."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import dataclass

from kvflow.loadgen.workload import (
    BenchRequest,
    Segment,
    TextBlock,
    content_namespace,
    scaled,
)


@dataclass(frozen=True)
class NoReuseWorkload:
    prompt_words: int = 512
    output_tokens: int = 32
    input_scale: float = 1.0
    output_scale: float = 1.0
    name: str = "no-reuse"

    def requests(self, *, seed: int, namespace: str) -> Iterator[BenchRequest]:
        content = content_namespace(seed, namespace)
        # One block per request, its key unique: with 512 words, two prompts agree on their
        # first 16 words (one KV block) with probability 512**-16, i.e. never.
        for i in itertools.count():
            yield BenchRequest(
                request_id=f"{namespace}-{i}",
                namespace=content,
                session_id=f"{namespace}-{i}",
                segments=(
                    Segment(
                        "user",
                        (TextBlock(f"prompt-{i}", scaled(self.prompt_words, self.input_scale)),),
                    ),
                ),
                num_output_tokens=scaled(self.output_tokens, self.output_scale),
            )
