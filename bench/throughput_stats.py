"""The pure parts of ``engine_throughput.py``: workloads, the interleaving order of the arms,
and the statistics over runs. No clock, no torch, no model: unit-tested on their own."""

from __future__ import annotations

import argparse
import random
import statistics
from collections.abc import Mapping, Sequence
from dataclasses import dataclass


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)

    @property
    def max_request_tokens(self) -> int:
        return max(len(p) + n for p, n in zip(self.prompts, self.output_lens, strict=True))

    @property
    def static_useful_fraction(self) -> float:
        """Of the output slots a static batch computes (every row runs until the longest
        request is done), the fraction that are requested tokens: the waste continuous
        batching removes is one minus this."""
        return self.num_output_tokens / (len(self.output_lens) * max(self.output_lens))


@dataclass(frozen=True)
class WorkloadSpec:
    num_requests: int
    prompt_len: tuple[int, int]
    output_len: tuple[int, int]


# The full workload: 64 requests, prompts and outputs uniform in 32-256 tokens.
FULL = WorkloadSpec(64, (32, 256), (32, 256))
# --quick: the full workload's 64 requests with prompts and outputs half as long (16-128
# tokens): half the tokens, prompt and output tokens in the same proportion, a static batch
# wasting as much. The batch is what must not shrink: on tiny, 32 requests of the full
# lengths put kvflow 1.14x (1.07-1.31) ahead of transformers' continuous batching per run
# where 64 give 1.70x, and the earlier quick workloads of 16 requests showed the two even.
QUICK = WorkloadSpec(64, (16, 128), (16, 128))


def token_range(text: str) -> tuple[int, int]:
    """``LO,HI`` (uniform draws between them, both included) for --prompt-len/--output-len."""
    try:
        lo, hi = (int(x) for x in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"want LO,HI token counts, got {text!r}") from None
    if not 1 <= lo <= hi:
        raise argparse.ArgumentTypeError(f"want 1 <= LO <= HI, got {text!r}")
    return lo, hi


def make_workload(spec: WorkloadSpec, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    lens = [
        (rng.randint(*spec.prompt_len), rng.randint(*spec.output_len))
        for _ in range(spec.num_requests)
    ]
    # Token ids from 3 up: clear of the special tokens a real tokenizer puts first.
    prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in lens]
    return Workload(prompts, [o for _, o in lens])


def rotated(arms: Sequence[str], run: int) -> list[str]:
    """The arms in run ``run``'s order: rotated by one each run, so every arm goes first,
    last and in between as often as the runs allow (a slow phase of the machine, or a
    warm cache left by the arm before, does not always fall on the same arm)."""
    if not arms:
        return []
    k = run % len(arms)
    return [*arms[k:], *arms[:k]]


def spread(values: Sequence[float]) -> dict[str, float]:
    """Median and range of one arm's runs."""
    if not values:
        raise ValueError("no runs to summarize")
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def summarize_runs(runs: Sequence[Mapping[str, float]]) -> dict[str, dict[str, float]]:
    """Per arm, the median and range of its tokens per second over the runs; each run maps
    arm to tokens per second (an arm absent from a run is summarized over the others)."""
    arms = list(dict.fromkeys(arm for run in runs for arm in run))
    return {arm: spread([run[arm] for run in runs if arm in run]) for arm in arms}


def ratios_of_medians(summary: Mapping[str, Mapping[str, float]], base: str) -> dict[str, float]:
    """``base``'s median tokens per second over each other arm's median."""
    return {arm: summary[base]["median"] / s["median"] for arm, s in summary.items() if arm != base}


def ratio_spread(runs: Sequence[Mapping[str, float]], base: str, other: str) -> dict[str, float]:
    """The ratio within each run (both arms measured minutes apart), median and range: how
    much of the spread of the ratio of medians the machine's load put there."""
    return spread([run[base] / run[other] for run in runs if base in run and other in run])
