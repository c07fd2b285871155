"""Per-step cost of the sampler's logit shaping at batch 64 over SmolLM2's vocabulary.

Arms (every row of the batch shaped the same way, temperature 0.8 with top-p 0.95):
  plain        no shaping (the baseline sampler)
  penalties    presence + frequency + repetition (token counts kept on the device)
  logit_bias   300 biased tokens per request (OpenAI's maximum)
  min_tokens   EOS masked (every request still short of its min_tokens)
  processor    a per-request LogitsProcessor returning a bool mask every step
  all          all of the above
Each request has a 512-token prompt and its outputs grow by one token a step, as in decode.
The arms run round robin, one step each in turn. Reported per arm: the shaping alone
(``Sampler._shape``) and the whole ``sample()`` call, min and median over the steps.

    python bench/sampler_shaping.py [--device cuda] [--steps 50] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.sampler import Sampler

VOCAB = 49_152  # SmolLM2
BATCH = 64
PROMPT_LEN = 512


@dataclass
class History:
    prompt_token_ids: list[int]
    token_ids: list[int]


class HalfTheVocabulary:
    def __init__(self, device: torch.device) -> None:
        self.mask = torch.arange(VOCAB, device=device) % 2 == 0

    def allowed_token_mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        return self.mask


def arms(device: torch.device) -> dict[str, SamplingParams]:
    base = SamplingParams(temperature=0.8, top_p=0.95)
    bias = tuple((i * 97 % VOCAB, 5.0) for i in range(300))
    shaped = {
        "penalties": replace(
            base, presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.2
        ),
        "logit_bias": replace(base, logit_bias=tuple(sorted(bias))),
        "min_tokens": replace(base, min_tokens=10_000),
        "processor": replace(base, logits_processor=HalfTheVocabulary(device)),
    }
    everything = replace(
        shaped["penalties"],
        logit_bias=shaped["logit_bias"].logit_bias,
        min_tokens=10_000,
        logits_processor=HalfTheVocabulary(device),
    )
    return {"plain": base, **shaped, "all": everything}


class Arm:
    """One sampler and its batch's histories; ``step`` times one sample() call."""

    def __init__(self, params: SamplingParams, device: torch.device) -> None:
        gen = torch.Generator().manual_seed(0)
        self.params, self.device = params, device
        self.sampler = Sampler(device, eos_token_ids=[2])
        self.ids = [f"r{i}" for i in range(BATCH)]
        self.histories = []
        for _ in range(BATCH):
            prompt = torch.randint(0, VOCAB, (PROMPT_LEN,), generator=gen).tolist()
            self.histories.append(History(prompt, list(prompt)))
        self.logits = (torch.randn(BATCH, VOCAB, generator=gen) * 3).to(device)
        self.shape_ms: list[float] = []
        self.sample_ms: list[float] = []

    def _timed(self, call: Callable[[], object]) -> tuple[object, float]:
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        started = time.perf_counter()
        result = call()
        if self.device.type == "cuda":
            torch.cuda.synchronize()
        return result, (time.perf_counter() - started) * 1e3

    def step(self, record: bool) -> None:
        params = [self.params] * BATCH
        # The shaping alone (penalties, bias, masks), then the whole sample() call, which
        # shapes again (the counts are already current: no new tokens) and samples.
        _, shape_ms = self._timed(
            lambda: self.sampler._shape(self.logits, self.ids, params, self.histories)
        )
        out, sample_ms = self._timed(
            lambda: self.sampler.sample(self.logits, self.ids, params, histories=self.histories)
        )
        if record:
            self.shape_ms.append(shape_ms)
            self.sample_ms.append(sample_ms)
        assert isinstance(out, list)
        for h, t in zip(self.histories, out, strict=True):
            h.token_ids.append(t.token_id)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cpu")
    parser.add_argument("--steps", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    device = torch.device(args.device)
    runs = {name: Arm(params, device) for name, params in arms(device).items()}
    # Round robin, one step of each arm in turn: load from other processes on a shared
    # machine falls on every arm alike. 5 warm-up steps (the first counts the prompts).
    for step in range(args.steps + 5):
        for arm in runs.values():
            arm.step(record=step >= 5)
    results = {}
    for name, arm in runs.items():
        shape, sample = sorted(arm.shape_ms), sorted(arm.sample_ms)
        results[name] = {
            "shape_min_ms": shape[0], "shape_median_ms": statistics.median(shape),
            "sample_min_ms": sample[0], "sample_median_ms": statistics.median(sample),
        }  # fmt: skip
        print(f"{name:11s} shaping min {shape[0]:7.2f} median {statistics.median(shape):7.2f} ms"
              f" | whole sample() min {sample[0]:7.2f} median {statistics.median(sample):7.2f} ms",
              flush=True)  # fmt: skip
    report = {"device": str(device), "batch": BATCH, "vocab": VOCAB, "torch": torch.__version__,
              "threads": torch.get_num_threads(), "arms": results}  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2))
    json.dump(report, sys.stdout)
    print()


if __name__ == "__main__":
    main()
