"""Engine limits, with the sizing arithmetic behind the defaults."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.proto.block_hash import DEFAULT_BLOCK_SIZE


@dataclass(frozen=True, slots=True)
class SchedulerConfig:
    # 512 tokens per step: on 2 CPU cores a 135M model computes about 2-3k prompt tokens/s,
    # so a full step is ~0.2 s and decodes batched with a prefill chunk wait at most that
    # long (chunked prefill bounds inter-token latency). GPUs want 2048-8192.
    max_num_batched_tokens: int = 512
    max_num_seqs: int = 64
    max_model_len: int = 2048
    block_size: int = DEFAULT_BLOCK_SIZE
    # Past this many waiting requests a new one is refused at once (RESOURCE_EXHAUSTED with
    # a retry-after; queue_limits.py says why). None: unbounded, for simulations that study
    # queueing; a worker's --max-waiting-requests defaults to a bound.
    max_waiting_requests: int | None = None
    # Also refuse a request whose estimated wait (requests ahead / admissions per second)
    # is longer than this; None: no bound on time.
    max_queue_time_s: float | None = None

    def __post_init__(self) -> None:
        for name in ("max_num_batched_tokens", "max_num_seqs", "max_model_len", "block_size"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1, got {getattr(self, name)}")
        if self.max_waiting_requests is not None and self.max_waiting_requests < 1:
            raise ValueError(f"max_waiting_requests must be >= 1, got {self.max_waiting_requests}")
        if self.max_queue_time_s is not None and not self.max_queue_time_s > 0:
            raise ValueError(f"max_queue_time_s must be > 0, got {self.max_queue_time_s}")
