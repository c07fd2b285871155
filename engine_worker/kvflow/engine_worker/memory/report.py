"""What a worker holds, as its start-up log line and its /metrics gauges report it (pure)."""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


@dataclass(frozen=True)
class MemoryReport:
    """The worker's weights per dtype and its KV cache."""

    weight_bytes: dict[str, int]  # weight_memory.weight_memory(model); empty when simulated
    kv_cache_dtype: str  # as kv_layout names it: "bfloat16", "int8+float16scales"
    kv_cache_bytes: int
    num_blocks: int
    block_size: int
    how: str  # how the size was chosen, for the log line

    @property
    def num_tokens(self) -> int:
        return self.num_blocks * self.block_size

    def log_line(self) -> str:
        weights = " + ".join(f"{n / GIB:.2f} GiB {dtype}" for dtype, n in self.weight_bytes.items())
        return (
            f"memory: weights {weights or 'none'}; KV cache {self.kv_cache_dtype} "
            f"{self.kv_cache_bytes / GIB:.2f} GiB = {self.num_blocks} blocks of "
            f"{self.block_size} tokens = {self.num_tokens} tokens ({self.how})"
        )
