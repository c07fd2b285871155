"""What a request asks of the sampler, validated once when it arrives."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from kvflow.engine_worker.core.errors import InvalidRequestError

if TYPE_CHECKING:  # torch-side; the pure core only carries it to the sampler
    from kvflow.engine_worker.logits_processor import LogitsProcessor

MAX_TOP_LOGPROBS = 20  # OpenAI's limit for top_logprobs
MAX_PENALTY = 2.0  # OpenAI's range for presence and frequency penalties: [-2, 2]
MAX_LOGIT_BIAS = 100.0  # OpenAI's range for a bias: [-100, 100]
MAX_LOGIT_BIAS_ENTRIES = 300  # OpenAI's limit on logit_bias entries
# A temperature under this samples greedily (vLLM's _SAMPLING_EPS): dividing the logits by
# it overflows float32 to inf (1e-40 did), and the draw it would make is the top token.
GREEDY_TEMPERATURE = 1e-5


@dataclass(frozen=True, slots=True)
class SamplingParams:
    temperature: float = 1.0  # 0 (or under GREEDY_TEMPERATURE) means greedy
    top_k: int = 0  # 0 disables
    top_p: float = 1.0  # 1 disables
    min_p: float = 0.0  # 0 disables
    seed: int | None = None  # per-request generator: same output whatever the batch
    max_tokens: int | None = None  # None: until EOS or the context is full
    stop_token_ids: tuple[int, ...] = ()
    ignore_eos: bool = False
    logprobs: bool = False
    top_logprobs: int = 0
    # OpenAI: subtracted from a token's logit, once if it was generated (presence) and
    # once per time it was generated (frequency). Prompt tokens do not count.
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    # vLLM/HF: a token seen in the prompt or the output has its logit divided by this if
    # positive, multiplied if negative. 1 disables.
    repetition_penalty: float = 1.0
    # OpenAI: (token id, bias) pairs added to the logits, sorted by token id.
    logit_bias: tuple[tuple[int, float], ...] = ()
    # vLLM: EOS and stop tokens cannot be sampled before this many output tokens.
    min_tokens: int = 0
    # A per-request constraint the sampler asks every step (see logits_processor.py).
    logits_processor: LogitsProcessor | None = field(default=None, compare=False)

    @property
    def is_greedy(self) -> bool:
        return self.temperature < GREEDY_TEMPERATURE or self.top_k == 1

    @property
    def has_penalties(self) -> bool:
        """Whether sampling needs the request's token counts."""
        return (
            self.presence_penalty != 0.0
            or self.frequency_penalty != 0.0
            or self.repetition_penalty != 1.0
        )

    def validate(self, vocab_size: int) -> None:
        """Raise InvalidRequestError naming the first bad field."""
        bias_ids = [t for t, _ in self.logit_bias]
        checks: list[tuple[bool, str]] = [
            (
                self.temperature >= 0.0 and math.isfinite(self.temperature),
                f"temperature must be a finite number >= 0, got {self.temperature}",
            ),
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
            (
                -MAX_PENALTY <= self.presence_penalty <= MAX_PENALTY,
                f"presence_penalty must be in [-2, 2], got {self.presence_penalty}",
            ),
            (
                -MAX_PENALTY <= self.frequency_penalty <= MAX_PENALTY,
                f"frequency_penalty must be in [-2, 2], got {self.frequency_penalty}",
            ),
            (
                self.repetition_penalty > 0.0 and math.isfinite(self.repetition_penalty),
                f"repetition_penalty must be > 0 (1 disables it), got {self.repetition_penalty}",
            ),
            (
                len(self.logit_bias) <= MAX_LOGIT_BIAS_ENTRIES,
                f"logit_bias has {len(self.logit_bias)} entries; at most "
                f"{MAX_LOGIT_BIAS_ENTRIES} are allowed",
            ),
            (
                all(0 <= t < vocab_size for t in bias_ids),
                f"logit_bias token ids must be in [0, {vocab_size}), got "
                f"{next((t for t in bias_ids if not 0 <= t < vocab_size), None)}",
            ),
            (
                len(set(bias_ids)) == len(bias_ids),
                "logit_bias names a token id twice",
            ),
            (
                all(-MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS for _, b in self.logit_bias),
                f"logit_bias values must be in [-100, 100], got "
                f"{next((b for _, b in self.logit_bias if not -100 <= b <= 100), None)}",
            ),
            (self.min_tokens >= 0, f"min_tokens must be >= 0, got {self.min_tokens}"),
            (
                self.max_tokens is None or self.min_tokens <= self.max_tokens,
                f"min_tokens ({self.min_tokens}) must be <= max_tokens ({self.max_tokens})",
            ),
        ]
        for ok, message in checks:
            if not ok:
                raise InvalidRequestError(message)
