"""The kvflow arms of bench/engine_throughput.py: an engine over loaded weights, a workload
run through it to the last token, and the warm engine that serves every run (the
transformers arms: hf_arms.py; the thread each runs in: arm_thread.py)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from throughput_stats import Workload

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.core.engine import Engine
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.settings import WorkerSettings


def new_engine(model: str | None, loaded: Any, **overrides: Any) -> Engine:
    """An engine over ``loaded``, in the dtype its weights have (``build_worker`` takes it)."""
    settings = WorkerSettings(
        model=model, kv_cache_gib=overrides.pop("kv_cache_gib", 2.0), **overrides
    )
    return build_worker(settings, loaded=loaded).engine


def run_kvflow(engine: Engine, w: Workload) -> tuple[float, int]:
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )
    produced = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            produced += len(out.new_tokens)
    wall = time.perf_counter() - start
    assert produced == w.num_output_tokens, (produced, w.num_output_tokens)
    return wall, produced


class WarmEngine:
    """One engine for every run of an arm, primed on first use (untimed) with ``primer``;
    its prefix cache is emptied before each run, so no run is served another's prompts."""

    def __init__(self, make: Callable[[], Engine], primer: Workload) -> None:
        self._make = make
        self._primer = primer
        self._engine: Engine | None = None

    def run(self, w: Workload) -> tuple[float, int]:
        if self._engine is None:
            self._engine = self._make()
            run_kvflow(self._engine, self._primer)
        assert self._engine.kv_cache.pool.reset_prefix_cache(), "blocks still held"
        return run_kvflow(self._engine, w)
