"""Drive a real engine through a sweep of batch shapes and time every step.

Each sweep point submits ``num_requests`` prompts of ``prompt_tokens`` at once (half of the
points share a prefix, so later requests hit the cache and read KV they did not compute)
and steps the engine until all have generated ``output_tokens``: its steps cover whole
prefills, chunked prefills, prefill mixed with decodes and decode batches of every size on
the way down. The timed span is the whole ``Engine.step`` (scheduling, the forward pass,
sampling): what a simulated step stands for.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from kvflow.engine_worker.core.engine import Engine, ModelRunner, SampledToken
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.engine_worker.sim.fit import StepSample
from kvflow.engine_worker.sim.timing import step_shape
from kvflow.proto.step_model import StepShape


@dataclass(frozen=True, slots=True)
class SweepPoint:
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    shared_prefix_tokens: int = 0


def default_sweep(max_prompt_tokens: int, *, quick: bool = False) -> list[SweepPoint]:
    """Batches of 1-32 requests, prompts of 16 tokens up to ``max_prompt_tokens``."""
    batches = (1, 4, 16) if quick else (1, 2, 4, 8, 16, 32)
    prompts = [p for p in (16, 128, 512, 1024, 2048) if p <= max_prompt_tokens]
    points = []
    for i, (batch, prompt) in enumerate((b, p) for b in batches for p in prompts):
        shared = prompt // 2 if i % 2 and batch > 1 else 0
        points.append(SweepPoint(batch, prompt, 8 if quick else 16, shared))
    return points


class ShapeRecorder:
    """The engine's runner, noting each step's shape (the sweep's, and the calibration
    check's, which compares the real steps with the fitted model)."""

    def __init__(self, inner: ModelRunner) -> None:
        self.inner = inner
        self.last: StepShape | None = None

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        self.last = step_shape(output)
        return self.inner.execute(output)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


def _prompts(point: SweepPoint, vocab: int, rng: random.Random) -> Iterator[list[int]]:
    prefix = [rng.randrange(3, vocab) for _ in range(point.shared_prefix_tokens)]
    for _ in range(point.num_requests):
        rest = point.prompt_tokens - len(prefix)
        yield prefix + [rng.randrange(3, vocab) for _ in range(rest)]


def run_sweep(
    engine: Engine,
    points: Sequence[SweepPoint],
    *,
    seed: int = 0,
    clock: Callable[[], float] = time.perf_counter,
    on_point: Callable[[int, SweepPoint], None] | None = None,
) -> list[StepSample]:
    """Every step's shape and seconds, over all points (the first point is a warm-up and
    not returned: first calls allocate and compile)."""
    recorder = ShapeRecorder(engine.runner)
    engine.runner = recorder
    rng = random.Random(seed)
    vocab = engine.config.vocab_size
    samples: list[StepSample] = []
    try:
        for index, point in enumerate([points[0], *points]):
            if on_point is not None and index > 0:
                on_point(index - 1, point)
            params = SamplingParams(max_tokens=point.output_tokens, ignore_eos=True)
            for i, prompt in enumerate(_prompts(point, vocab, rng)):
                engine.add_request(f"sweep-{index}-{i}", prompt, params)
            while engine.has_unfinished_requests:
                recorder.last = None
                started_s = clock()
                engine.step()
                seconds = clock() - started_s
                if recorder.last is not None and index > 0:
                    samples.append(StepSample(recorder.last, seconds))
            engine.kv_cache.pool.reset_prefix_cache()  # the next point starts cold
    finally:
        engine.runner = recorder.inner
    return samples
