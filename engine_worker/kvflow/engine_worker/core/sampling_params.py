"""What a request asks of the sampler, validated once when it arrives."""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.engine_worker.core.errors import InvalidRequestError

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables
    seed: int | None = None  # per-request generator: same output whatever the batch
    max_tokens: int | None = None  # None: until EOS or the context is full
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0

    @property
    def is_greedy(self) -> bool:
        return self.temperature == 0.0 or self.top_k == 1

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        checks: list[tuple[bool, str]] = [
            (self.temperature >= 0.0, f"temperature must be >= 0, got {self.temperature}"),
            (self.top_k >= 0, f"top_k must be >= 0 (0 disables it), got {self.top_k}"),
            (0.0 < self.top_p <= 1.0, f"top_p must be in (0, 1], got {self.top_p}"),
            (0.0 <= self.min_p <= 1.0, f"min_p must be in [0, 1], got {self.min_p}"),
            (
                self.max_tokens is None or self.max_tokens >= 1,
                f"max_tokens must be >= 1, got {self.max_tokens}",
            ),
            (
                0 <= self.top_logprobs <= MAX_TOP_LOGPROBS,
                f"top_logprobs must be in [0, {MAX_TOP_LOGPROBS}], got {self.top_logprobs}",
            ),
            (
                all(0 <= t < vocab_size for t in self.stop_token_ids),
                f"stop_token_ids must be in [0, {vocab_size}), got {list(self.stop_token_ids)}",
            ),
            (self.seed is None or self.seed >= 0, f"seed must be >= 0, got {self.seed}"),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
