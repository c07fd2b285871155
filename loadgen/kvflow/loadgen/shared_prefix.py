"""Shared-prefix groups, in llm-d's shape: each group of users shares one system prompt.

llm-d's prefix-routing benchmark uses 150 groups of 5 users, a 6,000-token shared prefix,
1,200-token questions and 1,000 output tokens; the defaults here are that shape scaled down
for CPU runs, with several prefix lengths so groups differ in how much a hit saves (group
g gets ``prefix_words[g % len(prefix_words)]``). Every question is new, so what a cache
can reuse is exactly the group's prefix.
"""

from __future__ import annotations

import itertools
import random
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
class SharedPrefixWorkload:
    num_groups: int = 8
    users_per_group: int = 4
    prefix_words: tuple[int, ...] = (1024, 512, 256)
    question_words: int = 64
    output_tokens: int = 32
    input_scale: float = 1.0
    output_scale: float = 1.0
    name: str = "shared-prefix"

    def __post_init__(self) -> None:
        if self.num_groups < 1 or self.users_per_group < 1:
            raise ValueError("shared-prefix needs at least one group and one user per group")
        if not self.prefix_words or min(self.prefix_words) < 1:
            raise ValueError(f"prefix lengths must be positive, got {self.prefix_words}")

    def requests(self, *, seed: int, namespace: str) -> Iterator[BenchRequest]:
        rng = random.Random(f"{seed}/{namespace}/{self.name}")
        content = content_namespace(seed, namespace)
        for i in itertools.count():
            group = rng.randrange(self.num_groups)
            user = rng.randrange(self.users_per_group)
            prefix_words = self.prefix_words[group % len(self.prefix_words)]
            system = TextBlock(f"prefix-{group}", scaled(prefix_words, self.input_scale))
            question = TextBlock(f"question-{i}", scaled(self.question_words, self.input_scale))
            yield BenchRequest(
                request_id=f"{namespace}-{i}",
                namespace=content,
                session_id=f"group{group}-user{user}",
                segments=(Segment("system", (system,)), Segment("user", (question,))),
                num_output_tokens=scaled(self.output_tokens, self.output_scale),
            )
