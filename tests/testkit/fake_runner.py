"""A model runner for pure engine tests: deterministic tokens, and a check of its inputs.

It verifies what a real runner relies on: each scheduled request's block table covers the
tokens it computes, and no two running requests share a block they are writing.
"""

from __future__ import annotations

from kvflow.engine_worker.core.engine import SampledToken
from kvflow.engine_worker.core.scheduler import SchedulerOutput


class FakeRunner:
    def __init__(
        self, *, block_size: int, vocab_size: int, eos_token_id: int | None = None
    ) -> None:
        self.block_size = block_size
        self.vocab_size = vocab_size
        self.eos_token_id = eos_token_id
        self.num_steps = 0
        self.num_computed_tokens = 0
        self.released: list[str] = []

    def next_token(self, token_ids: list[int]) -> int:
        """A fixed function of the sequence so far: the same prompt gives the same output."""
        token = (sum(token_ids[-3:]) * 31 + len(token_ids)) % self.vocab_size
        if token == self.eos_token_id:
            token = (token + 1) % self.vocab_size
        return token

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        self.num_steps += 1
        written: dict[int, str] = {}
        sampled: dict[str, SampledToken] = {}
        for s in output.scheduled:
            end = s.num_computed_tokens + s.num_new_tokens
            assert len(s.block_ids) * self.block_size >= end, "block table shorter than the context"
            first_written_block = s.num_computed_tokens // self.block_size
            for block_id in s.block_ids[first_written_block : -(-end // self.block_size)]:
                owner = written.setdefault(block_id, s.request.request_id)
                assert owner == s.request.request_id, f"block {block_id} written by two requests"
            self.num_computed_tokens += s.num_new_tokens
            if s.samples:
                tokens = s.request.token_ids
                sampled[s.request.request_id] = SampledToken(self.next_token(tokens))
        return sampled

    def release(self, request_id: str) -> None:
        self.released.append(request_id)
