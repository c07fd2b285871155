"""Drive an in-process engine through waves of requests and record what it did, step by step.

The record comes from the engine itself: what the runner was asked to compute each step
(so a (re)admission's ``num_computed_tokens`` shows its prefix-cache hit), which requests
were preempted and after how many output tokens, and every KV event drained after each
step. Tests assert on it that preemption, eviction and cache reuse really took place.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from kvflow.engine_worker.core.engine import Engine, ModelRunner, SampledToken
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.proto.block_hash import BlockHash

MAX_STEPS = 5_000  # a livelocked scheduler fails here instead of hanging the suite


@dataclass(frozen=True)
class Arrival:
    """A request added once every earlier wave has finished, ``delay_steps`` into its wave."""

    request_id: str
    prompt: list[int]
    max_tokens: int
    wave: int
    delay_steps: int = 0


@dataclass(frozen=True)
class Scheduled:
    step: int
    request_id: str
    num_computed_tokens: int  # before this step: > 0 on (re)admission means a cache hit
    num_new_tokens: int
    is_admission: bool  # the first step after arrival or after a preemption


@dataclass
class Trace:
    """What happened, step by step, as the engine itself reported it."""

    block_size: int
    outputs: dict[str, list[int]] = field(default_factory=dict)
    requests: dict[str, Request] = field(default_factory=dict)
    scheduled: list[Scheduled] = field(default_factory=list)
    # (step, request id, output tokens it had generated when it was preempted)
    preemptions: list[tuple[int, str, int]] = field(default_factory=list)
    events: list[tuple[int, KvEventKind, BlockHash]] = field(default_factory=list)

    def hits(self) -> list[tuple[int, str, list[BlockHash]]]:
        """(step, request id, the block hashes it was served from cache) per admission."""
        found = []
        for s in self.scheduled:
            if s.is_admission and s.num_computed_tokens > 0:
                hashes = self.requests[s.request_id].block_hashes
                found.append(
                    (s.step, s.request_id, hashes[: s.num_computed_tokens // self.block_size])
                )
        return found

    def hits_on_recached_blocks(self) -> list[tuple[str, BlockHash]]:
        """Hits on a hash that had been evicted (REMOVED) and then stored again before the hit."""
        found = []
        for step, request_id, hashes in self.hits():
            for block_hash in hashes:
                history = [kind for s, kind, h in self.events if h == block_hash and s <= step]
                last_store = len(history) - 1 - history[::-1].index(KvEventKind.STORED)
                if KvEventKind.REMOVED in history[:last_store]:
                    found.append((request_id, block_hash))
        return found


class RecordingRunner:
    """The real runner, and a note of what each step asked of it."""

    def __init__(self, inner: ModelRunner, trace: Trace) -> None:
        self.inner, self.trace = inner, trace
        self.step = 0
        self._running: set[str] = set()

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        for r in output.preempted:
            self.trace.preemptions.append((self.step, r.request_id, r.num_output_tokens))
            self._running.discard(r.request_id)
        for s in output.scheduled:
            rid = s.request.request_id
            self.trace.scheduled.append(
                Scheduled(
                    self.step,
                    rid,
                    s.num_computed_tokens,
                    s.num_new_tokens,
                    rid not in self._running,
                )
            )
            self._running.add(rid)
        return self.inner.execute(output)

    def release(self, request_id: str) -> None:
        self._running.discard(request_id)
        self.inner.release(request_id)


def run_waves(engine: Engine, arrivals: Sequence[Arrival]) -> Trace:
    """Greedy-decode every arrival; the output of a request that stopped ends in its stop token."""
    trace = Trace(block_size=engine.config.scheduler.block_size)
    recorder = RecordingRunner(engine.runner, trace)
    engine.runner = recorder
    for wave in sorted({a.wave for a in arrivals}):
        pending = sorted((a for a in arrivals if a.wave == wave), key=lambda a: a.delay_steps)
        wave_start = recorder.step
        while pending or engine.has_unfinished_requests:
            while pending and pending[0].delay_steps <= recorder.step - wave_start:
                a = pending.pop(0)
                params = SamplingParams(temperature=0.0, max_tokens=a.max_tokens)
                trace.requests[a.request_id] = engine.add_request(a.request_id, a.prompt, params)
                trace.outputs[a.request_id] = []
            for out in engine.step():
                tokens = trace.outputs[out.request_id]
                tokens.extend(t.token_id for t in out.new_tokens)
                if out.stop_token_id is not None:
                    tokens.append(out.stop_token_id)
            for event in engine.kv_cache.pool.events.drain():
                trace.events.extend((recorder.step, event.kind, h) for h in event.block_hashes)
            recorder.step += 1
            assert recorder.step < MAX_STEPS, "the engine stopped making progress"
    return trace
