"""Replay a Mooncake-format trace: its arrival times, lengths and shared prefix blocks.

Each hash id becomes a block of words keyed by the id, so requests that share ids share
identical text, block for block; the last block of a prompt is cut to the prompt's length
(a prefix of the full block, see ``text.block_word_ids``). Lengths scale by
``input_scale`` (block size included, so every id still covers its share of the prompt)
and ``output_scale``: the synthetic trace's 15,000-token average prompt at 0.04 is about
600 words, inside a small model's 8,192-token context.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass

from kvflow.loadgen.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord
from kvflow.loadgen.workload import (
    BenchRequest,
    Segment,
    TextBlock,
    content_namespace,
    scaled,
)


@dataclass(frozen=True)
class TraceWorkload:
    records: Sequence[TraceRecord]
    input_scale: float = 1.0
    output_scale: float = 1.0
    block_tokens: int = MOONCAKE_BLOCK_TOKENS
    name: str = "trace"

    def _blocks(self, index: int, record: TraceRecord) -> tuple[TextBlock, ...]:
        block_words = scaled(self.block_tokens, self.input_scale)
        remaining = scaled(record.input_length, self.input_scale)
        blocks = []
        for hash_id in record.hash_ids:
            if remaining <= 0:
                break
            n = min(block_words, remaining)
            blocks.append(TextBlock(f"hash-{hash_id}", n))
            remaining -= n
        if remaining > 0:  # a trace whose ids cover only part of the prompt: the rest is new
            blocks.append(TextBlock(f"tail-{index}", remaining))
        return tuple(blocks)

    def requests(self, *, seed: int, namespace: str) -> Iterator[BenchRequest]:
        content = content_namespace(seed, namespace)
        start_ms = self.records[0].timestamp_ms if self.records else 0.0
        for i, record in enumerate(self.records):
            yield BenchRequest(
                request_id=f"{namespace}-{i}",
                namespace=content,
                session_id=f"{namespace}-{i}",
                segments=(Segment("user", self._blocks(i, record)),),
                num_output_tokens=scaled(record.output_length, self.output_scale),
                trace_offset_s=(record.timestamp_ms - start_ms) / 1e3,
            )
