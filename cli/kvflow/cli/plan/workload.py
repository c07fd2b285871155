"""The traffic a plan is for: a mix of input/output lengths, a target load and SLOs.

Averages over the mix are weighted the way each quantity accrues: per request for prompt
tokens, per decode step (that is, by output length) for what a running request holds or
reads. A request with 10x the output tokens sits in the batch 10x as long.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.cli.plan.errors import PlanError
from kvflow.proto.cli_args import is_positive


@dataclass(frozen=True, slots=True)
class LengthClass:
    input_tokens: int
    output_tokens: int
    share: float  # of requests; the mix's shares are normalised to sum to 1

    @property
    def context_tokens(self) -> int:
        return self.input_tokens + self.output_tokens


@dataclass(frozen=True, slots=True)
class Workload:
    classes: tuple[LengthClass, ...]

    def __post_init__(self) -> None:
        assert self.classes and abs(sum(c.share for c in self.classes) - 1) < 1e-9

    @property
    def mean_input_tokens(self) -> float:
        return sum(c.share * c.input_tokens for c in self.classes)

    @property
    def mean_output_tokens(self) -> float:
        return sum(c.share * c.output_tokens for c in self.classes)

    @property
    def max_input_tokens(self) -> int:
        return max(c.input_tokens for c in self.classes)

    @property
    def max_context_tokens(self) -> int:
        return max(c.context_tokens for c in self.classes)

    def _per_step(self, value: list[float]) -> float:
        """Mean over decode steps: class ``i`` spends output_tokens_i steps in the batch."""
        steps = [c.share * c.output_tokens for c in self.classes]
        return sum(s * v for s, v in zip(steps, value, strict=True)) / sum(steps)

    @property
    def held_context_tokens(self) -> float:
        """A running request's KV reservation: its whole context (input + output), per step."""
        return self._per_step([c.context_tokens for c in self.classes])

    @property
    def read_context_tokens(self) -> float:
        """KV one decode step reads per request: input + half the output on average."""
        return self._per_step([c.input_tokens + c.output_tokens / 2 for c in self.classes])


def workload(input_tokens: int, output_tokens: int) -> Workload:
    """One request shape."""
    return make_workload([(input_tokens, output_tokens, 1.0)])


def make_workload(classes: list[tuple[int, int, float]]) -> Workload:
    for input_tokens, output_tokens, share in classes:
        if input_tokens < 1 or output_tokens < 1 or share <= 0:
            raise PlanError(
                f"length class {input_tokens}:{output_tokens}:{share}: input and output "
                "tokens must be >= 1 and the share > 0"
            )
    total = sum(share for _, _, share in classes)
    return Workload(tuple(LengthClass(i, o, s / total) for i, o, s in classes))


def parse_mix(text: str) -> Workload:
    """``IN:OUT[:SHARE],...``, e.g. ``512:128:3,4096:512:1`` (3 short requests per long one)."""
    classes: list[tuple[int, int, float]] = []
    for item in text.split(","):
        parts = item.strip().split(":")
        try:
            if len(parts) not in (2, 3):
                raise ValueError
            share = float(parts[2]) if len(parts) == 3 else 1.0
            classes.append((int(parts[0]), int(parts[1]), share))
        except ValueError:
            raise PlanError(
                f"--mix item {item!r}: expected INPUT:OUTPUT[:SHARE] tokens, "
                "e.g. --mix 512:128:3,4096:512:1"
            ) from None
    return make_workload(classes)


@dataclass(frozen=True, slots=True)
class Target:
    """The load to serve: concurrent requests or arrivals per second (one, or neither)."""

    concurrency: int | None = None
    rate_per_s: float | None = None

    def __post_init__(self) -> None:
        if self.concurrency is not None and self.rate_per_s is not None:
            raise PlanError("give --concurrency or --rate, not both")
        if self.concurrency is not None and self.concurrency < 1:
            raise PlanError(f"--concurrency must be >= 1, got {self.concurrency}")
        if self.rate_per_s is not None and not is_positive(self.rate_per_s):
            raise PlanError(f"--rate must be > 0 requests per second, got {self.rate_per_s}")


@dataclass(frozen=True, slots=True)
class Slo:
    """Latency objectives; None: not constrained."""

    ttft_s: float | None = None  # time to first token, for the longest prompt of the mix
    tpot_s: float | None = None  # time per output token, between tokens of a stream

    def __post_init__(self) -> None:
        for name, value in (("--ttft-ms", self.ttft_s), ("--tpot-ms", self.tpot_s)):
            if value is not None and not is_positive(value):
                raise PlanError(f"{name} must be > 0, got {value * 1e3:g}")
