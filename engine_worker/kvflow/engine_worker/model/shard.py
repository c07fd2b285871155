"""Which slice of the model a tensor-parallel rank holds, and which models split at all.

Megatron's split: Q, K and V by heads and gate/up by the MLP's width (column-parallel,
each rank a slice of the output rows), the attention output and down projections by the
same (row-parallel, a slice of the input columns, their partial products summed across
ranks), the embedding and the LM head by vocabulary. Every dimension split must divide by
the number of ranks; a model whose heads do not (SmolLM2-135M has 9 query and 3 KV heads,
so it runs on 1 or 3 ranks, not 2) is refused with the reason. KV heads are not copied
across ranks: a rank with no KV head of its own has nothing to attend with.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.errors import ModelLoadError


@dataclass(frozen=True)
class Shard:
    """Rank ``rank`` of ``size``; ``Shard(0, 1)`` is the whole model."""

    rank: int = 0
    size: int = 1

    def part(self, total: int) -> tuple[int, int]:
        """This rank's ``[start, stop)`` of ``total`` split evenly."""
        assert total % self.size == 0, (total, self.size)
        each = total // self.size
        return self.rank * each, (self.rank + 1) * each


def tensor_parallel_problem(config: ModelConfig, size: int) -> str | None:
    """Why ``config``'s model cannot split over ``size`` ranks, or None when it can."""
    if size < 1:
        return f"a tensor-parallel size of {size}: it must be at least 1"
    dims = [
        ("attention heads", config.num_attention_heads),
        ("KV heads", config.num_key_value_heads),
        ("MLP width (intermediate_size)", config.intermediate_size),
        ("vocabulary entries", config.vocab_size),
    ]
    for what, count in dims:
        if count % size:
            fits = [n for n in range(1, 17) if all(c % n == 0 for _, c in dims)]
            return (
                f"{config.name}'s {count} {what} do not divide among {size} ranks; it "
                f"splits over {', '.join(map(str, fits))} (--tensor-parallel-size)"
            )
    return None


def check_tensor_parallel(config: ModelConfig, size: int, source: str) -> None:
    if (problem := tensor_parallel_problem(config, size)) is not None:
        raise ModelLoadError(f"{source}: {problem}")
