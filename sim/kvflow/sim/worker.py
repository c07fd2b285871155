"""One simulated worker in virtual time: a real ``Engine`` stepped on the event clock.

The engine and its scheduler, block pool and prefix cache are the real ones; the runner is
the simulated worker's own (``SimulatedRunner``) with its ``sleep`` pointed at this
worker's clock. A step runs at once when the event clock reaches it, charging its timing
model's seconds to the worker's clock, and what it produced (tokens, KV events, the load
the worker would report) is published only when the clock reaches the step's end, as a
real worker publishes after its forward pass. Requests that arrive meanwhile wait for the
next step, as in the real engine loop.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from kvflow.engine_worker.core.engine import Engine, EngineConfig, RequestOutput
from kvflow.engine_worker.core.kv_events import KvEvent
from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.sim.timing import StepTimer
from kvflow.engine_worker.sim_runner import SimulatedRunner
from kvflow.proto.priority_class import PriorityClass
from kvflow.proto.step_model import StepTiming
from kvflow.router.workers.book import LoadReport
from kvflow.sim.events import EventQueue

StepDone = Callable[["SimWorker", list[RequestOutput], list[KvEvent]], None]


class SimWorker:
    def __init__(
        self,
        worker_id: str,
        config: EngineConfig,
        timing: StepTiming | StepTimer,
        events: EventQueue,
        on_step_done: StepDone,
        *,
        kv_bytes_per_block: int = 1,
    ) -> None:
        self.worker_id = worker_id
        self._events = events
        self._on_step_done = on_step_done
        self._local_s = 0.0
        self.runner = SimulatedRunner(
            vocab_size=config.vocab_size,
            eos_token_ids=config.eos_token_ids,
            timing=timing,
            sleep=self._advance,
            kv_bytes_per_block=kv_bytes_per_block,
            block_size=config.scheduler.block_size,
        )
        self.engine = Engine(config, self.runner, clock=lambda: self._local_s)
        self._kv_capacity_tokens = config.num_kv_blocks * config.scheduler.block_size
        self._cached_at_add: dict[str, int] = {}  # request -> cached prompt tokens, until it runs
        # The last step's report, as the router reads a Load answer, and when it was taken.
        self.load = LoadReport(kv_capacity_tokens=self._kv_capacity_tokens)
        self.load_at_s = 0.0
        self._is_stepping = False
        self.num_steps = 0
        self.busy_s = 0.0

    def _advance(self, delay_s: float) -> None:
        self._local_s += delay_s

    def _sync(self) -> None:
        self._local_s = self._events.now_s

    # -- what the cluster asks (the worker's gRPC calls, in process) --------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: Sequence[int],
        sampling: SamplingParams,
        *,
        wants_remote_kv: bool = False,
        tenant: str | None = None,
        priority_class: PriorityClass = PriorityClass.NORMAL,
    ) -> Request:
        """``tenant`` keys the engine's fair share (None: one shared tenant, as before);
        ``priority_class`` is the class the gateway put on the wire."""
        self._sync()
        request = self.engine.add_request(
            request_id, prompt_token_ids, sampling, wants_remote_kv=wants_remote_kv,
            tenant=tenant, priority_class=priority_class,
        )  # fmt: skip
        self._cached_at_add[request_id] = self._num_cached_tokens(request)
        self.kick()
        return request

    def _num_cached_tokens(self, request: Request) -> int:
        """The prompt's leading tokens the prefix cache holds now (the load report counts a
        waiting prompt less these, as its prefill will). The hashes are the ones the
        scheduler computes for the request anyway (incrementally, once)."""
        kv_cache = self.engine.kv_cache
        if not kv_cache.enable_prefix_caching:
            return 0
        kv_cache._update_hashes(request)  # the same hashes the scheduler computes, once
        num = 0
        for block_hash in request.block_hashes:
            if kv_cache.pool.get_cached_block(block_hash) is None:
                break
            num += 1
        return min(num * kv_cache.block_size, request.num_prompt_tokens - 1)

    def add_prefill_request(
        self, request_id: str, prompt_token_ids: Sequence[int], first_token: int, end_token: int
    ) -> Request:
        self._sync()
        request = self.engine.add_prefill_request(
            request_id, prompt_token_ids, first_token=first_token, end_token=end_token
        )
        self.kick()
        return request

    def remote_kv_landed(self, request_id: str) -> None:
        self._sync()
        landed = self.engine.remote_kv_landed(request_id)
        assert landed, f"{self.worker_id}: {request_id} was not waiting for KV"
        self.kick()

    def complete_kv_send(self, request_id: str) -> RequestOutput:
        self._sync()
        output = self.engine.complete_kv_send(request_id, is_sent=True)
        assert output is not None, f"{self.worker_id}: {request_id} was not sending KV"
        self.kick()
        return output

    # -- stepping ------------------------------------------------------------------------

    def kick(self) -> None:
        """Step when the clock next runs, unless a step is under way or nothing can run.
        (Not at once: requests arriving at the same instant join the same step.)"""
        if not self._is_stepping and self.engine.has_schedulable_work:
            self._is_stepping = True
            self._events.at(self._events.now_s, self._step)

    def _step(self) -> None:
        self._sync()
        start_s = self._local_s
        outputs = self.engine.step()
        kv_events = self.engine.kv_cache.pool.events.drain()
        if self.engine.last_step_was_idle and not kv_events:
            # Nothing fits until something else happens (a transfer lands, a request
            # ends elsewhere): the next add or landing kicks the worker again.
            self._is_stepping = False
            return
        self.num_steps += 1
        self.busy_s += self._local_s - start_s
        self._events.at(self._local_s, lambda: self._finish(outputs, kv_events))

    def _finish(self, outputs: list[RequestOutput], kv_events: list[KvEvent]) -> None:
        self._is_stepping = False
        scheduler = self.engine.scheduler
        num_prefill = num_decode = num_kv = 0
        cached_at_add = self._cached_at_add
        for request in self.engine.requests.values():
            computed = request.num_computed_tokens or cached_at_add.get(request.request_id, 0)
            left = request.num_prompt_tokens - computed
            if request.num_computed_tokens:
                cached_at_add.pop(request.request_id, None)
            if left > 0:
                num_prefill += left
            else:
                num_decode += 1
                num_kv += request.num_computed_tokens
        self.load = LoadReport(  # a simulated worker's queue is unbounded
            num_waiting=scheduler.num_waiting,
            num_running=scheduler.num_running,
            kv_usage=self.engine.kv_cache.pool.usage,
            queue_drain_rate_per_s=self.engine.queue_stats.drain_rate_per_s,
            num_prefill_tokens=num_prefill,
            num_decode_seqs=num_decode,
            num_kv_tokens=num_kv,
            kv_capacity_tokens=self._kv_capacity_tokens,
            num_cached_tokens=(
                self.engine.kv_cache.pool.num_cached_blocks * self.engine.kv_cache.block_size
            ),
        )
        self.load_at_s = self._events.now_s
        self._on_step_done(self, outputs, kv_events)
        self.kick()
