"""A simulated worker's engine does exactly what the real one does with its blocks.

The same request sequence, the same scheduler limits and KV pool, over the real torch
runner (the tiny random Llama), over the virtual cluster's simulated worker, and over the
worker `kvflow worker --simulate` builds from the same flags: every step schedules the
same requests for the same tokens, preempts the same requests, serves the same prefix hits
and publishes the same KV events. The tokens differ (one is a model, the other a hash), so
block hashes are compared by what they name: the request and block index that first held
them. The pool is tight enough that every path (hit, preemption with recompute, eviction,
re-stored blocks) happens, which the test checks too.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest
import torch
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.core.engine import Engine, ModelRunner, SampledToken
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.engine_worker.settings import WorkerSettings
from kvflow.proto.block_hash import BlockHash
from kvflow.proto.step_model import StepTiming
from kvflow.sim.events import EventQueue
from kvflow.sim.worker import SimWorker

BLOCK_SIZE = 4
# 18 blocks of 4: wave 0's four prompts sharing 3 blocks outgrow it (preemption), wave 1
# evicts wave 0's cached blocks, wave 2 stores the shared prefix again and hits it (the
# sizing of tests/engine/test_preemption_parity.py, whose real runner this mirrors).
NUM_BLOCKS = 18
VOCAB = 4096


@dataclass(frozen=True)
class Arrival:
    request_id: str
    prompt: list[int]
    max_tokens: int
    wave: int
    delay_steps: int = 0


@dataclass
class Trace:
    steps: list[tuple[tuple[str, int, int], ...]] = field(default_factory=list)
    preempted: list[tuple[int, str]] = field(default_factory=list)
    events: list[tuple[int, KvEventKind, BlockHash]] = field(default_factory=list)
    requests: dict[str, Request] = field(default_factory=dict)

    def named(self) -> dict[BlockHash, tuple[str, int]]:
        """Each hash -> (request, block index) of the first request that held it."""
        names: dict[BlockHash, tuple[str, int]] = {}
        for rid, request in self.requests.items():
            for i, h in enumerate(request.block_hashes):
                names.setdefault(h, (rid, i))
        return names

    def canonical_events(self) -> list[tuple[int, str, tuple[str, int]]]:
        names = self.named()
        return [(step, kind.name, names[h]) for step, kind, h in self.events]

    def cached_tokens(self) -> dict[str, int]:
        return {rid: r.num_cached_tokens for rid, r in self.requests.items()}


class _Recorder:
    def __init__(self, inner: ModelRunner, trace: Trace) -> None:
        self.inner, self.trace = inner, trace

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        step = len(self.trace.steps)
        self.trace.preempted += [(step, r.request_id) for r in output.preempted]
        self.trace.steps.append(
            tuple(
                (s.request.request_id, s.num_computed_tokens, s.num_new_tokens)
                for s in output.scheduled
            )
        )
        return self.inner.execute(output)

    def release(self, request_id: str) -> None:
        self.inner.release(request_id)


def run(engine: Engine, arrivals: list[Arrival]) -> Trace:
    trace = Trace()
    engine.runner = _Recorder(engine.runner, trace)
    for wave in sorted({a.wave for a in arrivals}):
        pending = sorted((a for a in arrivals if a.wave == wave), key=lambda a: a.delay_steps)
        start = len(trace.steps)
        while pending or engine.has_unfinished_requests:
            while pending and pending[0].delay_steps <= len(trace.steps) - start:
                a = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens, ignore_eos=True)
                trace.requests[a.request_id] = engine.add_request(a.request_id, a.prompt, params)
            engine.step()
            step = len(trace.steps)
            for event in engine.kv_cache.pool.events.drain():
                trace.events += [(step, event.kind, h) for h in event.block_hashes]
            assert step < 2000, "the engine stopped making progress"
    return trace


def arrivals() -> list[Arrival]:
    gen = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(3, VOCAB, (n,), generator=gen).tolist()

    shared, other = rand(13), rand(9)
    out = [Arrival(f"w0-{i}", shared + rand(3 + 2 * i), 16, 0, i) for i in range(4)]
    out += [Arrival(f"w1-{i}", other + rand(8 + i), 16, 1) for i in range(3)]
    out += [Arrival(f"w2-{i}", shared + rand(2 + i), 12, 2, 3 * i) for i in range(3)]
    out.append(Arrival("w2-repeat", out[0].prompt, 16, 2, 2))
    return out


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=3,
                           num_hidden_layers=2, vocab_size=VOCAB)  # fmt: skip
    torch.set_num_threads(before)


def engines(tiny_path: Path) -> tuple[Engine, Engine, Engine]:
    """The real worker; the virtual cluster's simulated worker over the same config; and
    the wall-time simulated worker `kvflow worker --simulate` builds with the same flags."""
    flags = {"block_size": BLOCK_SIZE, "num_kv_blocks": NUM_BLOCKS}
    real = build_worker(WorkerSettings(model=str(tiny_path), **flags)).engine  # type: ignore[arg-type]
    timing = StepTiming(base_step_s=1e-3, per_prefill_token_s=1e-4)
    virtual = SimWorker("sim-0", real.config, timing, EventQueue(), lambda *a: None).engine
    wall = build_worker(WorkerSettings(simulate=True, **flags)).engine  # type: ignore[arg-type]
    return real, virtual, wall


def test_simulated_and_real_workers_cache_evict_and_preempt_alike(tiny_path: Path) -> None:
    real_engine, *simulated = engines(tiny_path)
    real = run(real_engine, arrivals())
    for sim_engine in simulated:
        sim = run(sim_engine, arrivals())
        assert sim.steps == real.steps
        assert sim.preempted == real.preempted
        assert sim.cached_tokens() == real.cached_tokens()
        assert sim.canonical_events() == real.canonical_events()
        assert sim_engine.kv_cache.pool.num_free_blocks == NUM_BLOCKS
    # Not vacuous: every path happened.
    kinds = {kind for _, kind, _ in real.canonical_events()}
    assert {"STORED", "REMOVED"} <= kinds
    assert real.preempted
    assert any(n > 0 for rid, n in real.cached_tokens().items() if rid.startswith("w2"))
    # Output blocks differ in content (a model vs a hash) and still line up by name.
    assert {h for _, _, h in real.events} != {h for _, _, h in sim.events}
    assert real_engine.kv_cache.pool.num_free_blocks == NUM_BLOCKS
