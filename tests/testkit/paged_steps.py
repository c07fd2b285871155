"""Drive a paged model by hand: feed chunks of several sequences per step, as a runner would.

Enough of a runner for model tests (no scheduler, no sampler): each step lays the given
sequences' new tokens end to end, grows their block tables from a shuffled free list (so
tables are scattered, as after real churn) and returns every new token's logits.
"""

from __future__ import annotations

import random
from collections.abc import Hashable, Mapping, Sequence
from typing import TypeVar

import torch

from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

Seq = TypeVar("Seq", bound=Hashable)


class PagedSteps:
    def __init__(
        self,
        model: LlamaForCausalLM,
        config: ModelConfig,
        *,
        num_blocks: int = 64,
        block_size: int = 4,
        seed: int = 0,
    ) -> None:
        self.model, self.block_size = model, block_size
        dtype = next(model.parameters()).dtype
        shape = kv_cache_shape(
            num_blocks=num_blocks,
            block_size=block_size,
            num_kv_heads=model.layers[0].self_attn.num_kv_heads,  # this rank's, under TP
            head_dim=config.head_dim,
        )
        self.kv_caches = [torch.zeros(shape, dtype=dtype) for _ in range(config.num_hidden_layers)]
        self.free_blocks = list(range(num_blocks))
        random.Random(seed).shuffle(self.free_blocks)
        self.block_tables: dict[Hashable, list[int]] = {}
        self.context_lens: dict[Hashable, int] = {}

    @torch.inference_mode()
    def step(self, chunks: Mapping[Seq, Sequence[int]]) -> dict[Seq, torch.Tensor]:
        """Run one forward over ``chunks`` (sequence -> its next tokens); float32 logits each
        (an empty dict on a tensor-parallel rank other than 0, which gets no logits)."""
        input_ids: list[int] = []
        positions: list[int] = []
        query_lens, context_lens, tables = [], [], []
        for seq, tokens in chunks.items():
            start = self.context_lens.get(seq, 0)
            end = start + len(tokens)
            table = self.block_tables.setdefault(seq, [])
            while len(table) * self.block_size < end:
                table.append(self.free_blocks.pop())
            self.context_lens[seq] = end
            input_ids.extend(tokens)
            positions.extend(range(start, end))
            query_lens.append(len(tokens))
            context_lens.append(end)
            tables.append(list(table))
        meta = AttentionMetadata.build(
            query_lens=query_lens,
            context_lens=context_lens,
            block_tables=tables,
            block_size=self.block_size,
        )
        ids = torch.tensor(input_ids, dtype=torch.int64)
        hidden = self.model(ids, torch.tensor(positions, dtype=torch.int64), self.kv_caches, meta)
        logits = self.model.compute_logits(hidden)
        if logits is None:
            return {}
        return dict(zip(chunks, torch.split(logits, query_lens), strict=True))
