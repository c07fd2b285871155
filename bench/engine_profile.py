"""Where one decode step's time goes: timers around the engine's parts, then torch's ops.

The timers wrap, for the profile only, the scheduler, the attention metadata, the model's
matrix multiplies (the layers' projections and the LM head), the paged attention (its
cache write and block gather apart) and the sampler. Torch runs CPU ops synchronously, so
wall time around a call is its cost. What no timer covers is named by subtraction: the
engine's own bookkeeping, the runner's tensor building, and the model's elementwise ops
(norms, RoPE, SiLU) with the Python between them. A torch.profiler pass over the same kind
of step then lists the top ops by self time.
"""

from __future__ import annotations

import random
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from typing import Any
from unittest import mock

import torch

from kvflow.engine_worker.core.engine import Engine
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.model import attention, attention_metadata, llama


class Timers:
    def __init__(self) -> None:
        self.total_s: dict[str, float] = defaultdict(float)

    def wrap(self, name: str, fn: Callable[..., Any]) -> Callable[..., Any]:
        def timed(*args: Any, **kwargs: Any) -> Any:
            start = time.perf_counter()
            try:
                return fn(*args, **kwargs)
            finally:
                self.total_s[name] += time.perf_counter() - start

        return timed


@contextmanager
def timed_engine(engine: Engine, timers: Timers) -> Iterator[None]:
    runner: Any = engine.runner
    model = runner.model
    metadata = attention_metadata.AttentionMetadata
    build = metadata.build
    with ExitStack() as stack:
        patches = [
            mock.patch.object(
                engine.scheduler, "schedule", timers.wrap("schedule", engine.scheduler.schedule)
            ),
            mock.patch.object(runner, "execute", timers.wrap("execute", runner.execute)),
            mock.patch.object(model, "forward", timers.wrap("forward", model.forward)),
            mock.patch.object(
                model, "compute_logits", timers.wrap("lm_head", model.compute_logits)
            ),
            mock.patch.object(
                runner.sampler, "sample", timers.wrap("sample", runner.sampler.sample)
            ),
            # The layer's four projections (the residual adds ride in two of them).
            mock.patch.object(llama, "_project", timers.wrap("linear", llama._project)),
            mock.patch.object(llama, "_add_projected", timers.wrap("linear", llama._add_projected)),
            mock.patch.object(metadata, "build", staticmethod(timers.wrap("metadata", build))),
            mock.patch.object(
                llama, "paged_attention", timers.wrap("attention", llama.paged_attention)
            ),
            mock.patch.object(attention, "write_kv", timers.wrap("kv_write", attention.write_kv)),
            mock.patch.object(attention, "gather_kv", timers.wrap("gather", attention.gather_kv)),
        ]
        for p in patches:
            stack.enter_context(p)
        yield


def _start(engine: Engine, *, vocab: int, batch: int, prompt_len: int, decode_steps: int) -> None:
    """Add ``batch`` requests and step until each has its first token."""
    rng = random.Random(7)
    for i in range(batch):
        prompt = [rng.randrange(3, vocab) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 1, ignore_eos=True)
        engine.add_request(f"p{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step() if out.new_tokens)


def split_step(total_s: dict[str, float], steps: int) -> dict[str, float]:
    """Milliseconds per step of each part; the ``*_other`` parts are by subtraction."""
    ms = {k: 1e3 * v / steps for k, v in total_s.items()}
    out = {
        "step": ms["step"],
        "engine_other (bookkeeping)": ms["step"] - ms["schedule"] - ms["execute"],
        "schedule": ms["schedule"],
        "runner_other (inputs)": ms["execute"]
        - ms["metadata"]
        - ms["forward"]
        - ms["lm_head"]
        - ms["sample"],
        "metadata": ms["metadata"],
        "linear (GEMMs)": ms["linear"],
        "attention total": ms["attention"],
        "  kv_write": ms["kv_write"],
        # none where decodes read the cache in place (model/cpu_paged.py)
        "  gather": ms.get("gather", 0.0),
        "  sdpa or paged kernel, and the rest": ms["attention"]
        - ms["kv_write"]
        - ms.get("gather", 0.0),
        "model_other (norm, rope, act)": ms["forward"] - ms["linear"] - ms["attention"],
        "lm_head": ms["lm_head"],
        "sample": ms["sample"],
    }
    return out


def profile_decode(
    engine: Engine, *, vocab: int, batch: int, prompt_len: int, decode_steps: int
) -> dict[str, Any]:
    """Timers over ``decode_steps`` steps of ``batch`` decodes, then torch's top ops over
    two more steps (timers and profiler apart: each would distort the other)."""
    _start(engine, vocab=vocab, batch=batch, prompt_len=prompt_len, decode_steps=decode_steps + 8)
    timers = Timers()
    with timed_engine(engine, timers):
        for _ in range(decode_steps):
            start = time.perf_counter()
            outs = engine.step()
            timers.total_s["step"] += time.perf_counter() - start
            assert len(outs) == batch
    activities = [torch.profiler.ProfilerActivity.CPU]
    with torch.profiler.profile(activities=activities) as prof:
        for _ in range(2):
            engine.step()
    top = sorted(prof.key_averages(), key=lambda e: e.self_cpu_time_total, reverse=True)[:12]
    return {
        "batch": batch,
        "steps": decode_steps,
        "ms_per_step": split_step(dict(timers.total_s), decode_steps),
        "top_ops_ms_per_step": {
            e.key: {"self_ms": e.self_cpu_time_total / 1e3 / 2, "calls": e.count // 2} for e in top
        },
    }
