"""Multi-turn conversations whose history grows: turn t sends every earlier message again.

The history's assistant messages are synthetic text of the requested output length, not
the server's actual answers: the workload stays a pure function of its seed (the same
prompts at every rate and against every server), and open-loop arrivals never wait for an
answer. A server's cache can still reuse everything up to the last user message of the
previous turn, which is what a real conversation reuses too (the answer's own KV, which a
real client would resend, is a bonus this workload does not claim).

``num_active`` conversations are in progress at once; each request continues one of them
at random, and a finished conversation (``num_turns`` turns) is replaced by a new one.
Under open-loop arrivals at R req/s a conversation's turns come about ``num_active / R``
seconds apart: keep that above the expected latency so turns rarely overlap.
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
class MultiTurnWorkload:
    num_active: int = 16
    num_turns: int = 5
    first_message_words: int = 256
    message_words: int = 64
    output_tokens: int = 32
    input_scale: float = 1.0
    output_scale: float = 1.0
    name: str = "multi-turn"

    def __post_init__(self) -> None:
        if self.num_active < 1 or self.num_turns < 1:
            raise ValueError("multi-turn needs at least one active conversation and one turn")

    def _segments(self, conversation: int, turn: int) -> tuple[Segment, ...]:
        segments = []
        for k in range(turn + 1):
            words = self.first_message_words if k == 0 else self.message_words
            user = TextBlock(f"conv{conversation}-user{k}", scaled(words, self.input_scale))
            segments.append(Segment("user", (user,)))
            if k < turn:
                # As long as the answer asked for, so the history grows as in a real chat.
                answer_words = scaled(self.output_tokens, self.output_scale)
                answer = TextBlock(f"conv{conversation}-assistant{k}", answer_words)
                segments.append(Segment("assistant", (answer,)))
        return tuple(segments)

    def requests(self, *, seed: int, namespace: str) -> Iterator[BenchRequest]:
        rng = random.Random(f"{seed}/{namespace}/{self.name}")
        content = content_namespace(seed, namespace)
        # (conversation, next turn) per slot.
        active = [(c, 0) for c in range(self.num_active)]
        next_conversation = self.num_active
        for i in itertools.count():
            slot = rng.randrange(len(active))
            conversation, turn = active[slot]
            yield BenchRequest(
                request_id=f"{namespace}-{i}",
                namespace=content,
                session_id=f"{namespace}-conv{conversation}",
                segments=self._segments(conversation, turn),
                num_output_tokens=scaled(self.output_tokens, self.output_scale),
            )
            if turn + 1 < self.num_turns:
                active[slot] = (conversation, turn + 1)
            else:
                active[slot] = (next_conversation, 0)
                next_conversation += 1
