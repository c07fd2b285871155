"""A virtual-time cluster: simulated workers, the router's placement, open-loop arrivals.

A request's life, as the gateway and the workers live it, on the event clock:
arrival -> admission control (when the spec sets it: the gateway's 503 past its queue-time
bound) -> placement (the arm's planner over the router side's views and block index) ->
Generate on the chosen worker (or, for a disaggregated plan, a reservation on the decode
worker, a Prefill on the prefill worker, the KV blocks moved at the profile's link
bandwidth, then decode) -> one token per step -> done. The client's record has the same
fields the wall-time bench records, so the same metrics and reports apply.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from functools import partial

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import EngineConfig, RequestOutput
from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.core.kv_events import KvEvent
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.engine_worker.sim.timing import StepTimer
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.workload import BenchRequest
from kvflow.proto.block_hash import make_hash_seed
from kvflow.proto.priority_class import PriorityClass
from kvflow.proto.roles import Role
from kvflow.proto.step_model import StepTiming
from kvflow.router.routing.block_hasher import CachedBlockHasher, PromptHashes
from kvflow.router.routing.cost import StepCosts
from kvflow.router.routing.placement import Colocated, PlacementRequest
from kvflow.router.routing.types import PREFIX_BLOCKS, WorkerId
from kvflow.router.serving.admission import AdmissionConfig, Verdict
from kvflow.sim.arms import Arm
from kvflow.sim.events import EventQueue
from kvflow.sim.floor import TtftFloor
from kvflow.sim.oracle import DiscountedTiming, GlobalPrefixCache
from kvflow.sim.prompts import PromptBuilder
from kvflow.sim.router_side import LOAD_INTERVAL_S, RouterSide
from kvflow.sim.worker import SimWorker

# The simulated worker's vocabulary and EOS (app.py's SIM_*): workload word ids (< 512)
# are its token ids.
VOCAB_SIZE = 49152
EOS_TOKEN_IDS = (2,)


def step_costs(profile: SimProfile) -> StepCosts:
    """The router's view of the workers' step model: the profile's own coefficients (the
    simulated workers' timing, less its per-prefill-sequence term, which the router's
    model leaves out: a fitted profile's is a few ms per prompt, alike on every worker)."""
    return StepCosts(profile.timing, profile.max_num_batched_tokens)


@dataclass(frozen=True)
class ClusterSpec:
    profile: SimProfile
    num_workers: int = 8
    # Of those, how many are prefill workers (the rest decode); 0: all colocated.
    num_prefill_workers: int = 0
    num_kv_blocks: int | None = None  # per worker; None: the profile's
    max_model_len: int = 262_144
    model: str = "sim"
    # The gateway's admission control (router --admission-*); None: every request is placed.
    admission: AdmissionConfig | None = None

    def __post_init__(self) -> None:
        if self.num_workers < 1 or not 0 <= self.num_prefill_workers < self.num_workers:
            raise ValueError("a cluster needs a worker that streams tokens")

    def role(self, index: int) -> Role:
        if self.num_prefill_workers == 0:
            return Role.COLOCATED
        return Role.PREFILL if index < self.num_prefill_workers else Role.DECODE

    def engine_config(self) -> EngineConfig:
        p = self.profile
        return EngineConfig(
            scheduler=SchedulerConfig(
                max_num_batched_tokens=p.max_num_batched_tokens,
                max_num_seqs=p.max_num_seqs,
                max_model_len=self.max_model_len,
                block_size=p.block_size,
            ),
            num_kv_blocks=self.num_kv_blocks or p.num_kv_blocks,
            vocab_size=VOCAB_SIZE,
            eos_token_ids=EOS_TOKEN_IDS,
            hash_seed=make_hash_seed(self.model, f"vocab={VOCAB_SIZE}"),
        )


@dataclass
class _InFlight:
    request: BenchRequest
    arrival_s: float
    token_ids: list[int]
    worker: SimWorker
    prefill: SimWorker | None
    predicted_blocks: int | None
    free_tokens: int
    prefix_outcome: str | None  # kvflow.proto.prefix_outcome, where the router said
    token_times_s: list[float] = field(default_factory=list)


@dataclass(frozen=True)
class WorkerStats:
    worker_id: str
    num_steps: int
    busy_s: float


class VirtualCluster:
    def __init__(self, spec: ClusterSpec, arm: Arm, *, seed: int = 0) -> None:
        self.spec = spec
        self.events = EventQueue()
        config = spec.engine_config()
        self._config = config
        self._block_size = config.scheduler.block_size
        self._hasher = CachedBlockHasher()
        self._prompts = PromptBuilder()
        self._oracle = (
            GlobalPrefixCache(spec.num_workers * config.num_kv_blocks) if arm.is_ideal else None
        )
        self._free_tokens: dict[str, int] = {}
        # Each request's least possible TTFT (floor.py), for the comparison's targets.
        self.floor = TtftFloor(spec.profile.timing, config.scheduler.max_num_batched_tokens,
                               self._block_size)  # fmt: skip
        timing: StepTiming | StepTimer = spec.profile.timing
        if arm.is_ideal:
            timing = DiscountedTiming(spec.profile.timing, self._free_tokens)
        self.workers: dict[WorkerId, SimWorker] = {}
        for i in range(spec.num_workers):
            worker_id = WorkerId(f"sim-{i}")
            self.workers[worker_id] = SimWorker(
                worker_id, config, timing, self.events, self._on_step_done,
                kv_bytes_per_block=spec.profile.kv_bytes_per_block,
            )  # fmt: skip
        self.router = RouterSide(
            spec.model, [(w, spec.role(i)) for i, w in enumerate(self.workers)]
        )
        # The same random numbers for every arm (not seeded by the arm's name): two arms
        # whose policies agree then make the same choices, so a difference between arms is
        # their policies', not their draws' (a single TTFT P90 of a few hundred requests
        # moved by 18 % with the draws alone).
        rng = random.Random(f"{seed}/router")
        self._planner = arm.build(self.router.index, self.router.sessions, rng,
                                  step_costs(spec.profile))  # fmt: skip
        self._inflight: dict[str, _InFlight] = {}
        self._num_pending = 0  # submitted, not yet arrived
        self.records: list[RequestRecord] = []
        self._is_polling = False

    # -- the run -------------------------------------------------------------------------

    def submit(self, request: BenchRequest, at_s: float) -> None:
        self._num_pending += 1
        self.events.at(at_s, lambda: self._arrive(request))
        if not self._is_polling:
            self._is_polling = True
            n = len(self.workers)
            for i, worker_id in enumerate(self.workers):  # staggered, as independent tasks
                self.events.at(i * LOAD_INTERVAL_S / n, partial(self._poll, worker_id))

    def run(self) -> list[RequestRecord]:
        """Run every submitted request to its end; the records in arrival order."""
        self.events.run()
        assert not self._inflight, f"{len(self._inflight)} requests never finished"
        return sorted(self.records, key=lambda r: (r.sent_s, r.request_id))

    def worker_stats(self) -> list[WorkerStats]:
        return [WorkerStats(w.worker_id, w.num_steps, w.busy_s) for w in self.workers.values()]

    def _poll(self, worker_id: WorkerId) -> None:
        worker = self.workers[worker_id]
        self.router.poll(worker_id, worker.load, worker.load_at_s)
        if self._num_pending or self._inflight:
            self.events.after(LOAD_INTERVAL_S, lambda: self._poll(worker_id))
        else:
            self._is_polling = False

    # -- a request's life ----------------------------------------------------------------

    def _arrive(self, request: BenchRequest) -> None:
        self._num_pending -= 1
        now_s = self.events.now_s
        tokens = self._prompts.token_ids(request)
        self.floor.add(request.request_id, tokens, now_s)  # every request, every arm
        if self.spec.admission is not None:  # before any work on the prompt, as the gateway
            verdict = self.router.admit(self.spec.admission)
            if not verdict.is_admitted:
                self._refuse(request, now_s, verdict)
                return
        seed = self._config.hash_seed
        hashes = PromptHashes(self._hasher, tokens, self._block_size, seed)
        placement = PlacementRequest(
            self.spec.model, hashes, len(tokens), self._block_size, request.session_id
        )
        plan = self._planner.plan(placement, self.router.views(), now_s)
        if plan is None:
            self._fail(request, now_s, "no_worker", "no worker could take the request")
            return
        free = 0
        if self._oracle is not None:
            free = self._oracle.lookup_and_add(hashes, len(tokens), self._block_size)
            self._free_tokens[request.request_id] = free
        stream = self.workers[plan.stream_worker]
        prefill = None if isinstance(plan, Colocated) else self.workers[plan.prefill.worker_id]
        decision = plan.worker if isinstance(plan, Colocated) else plan.decode
        has_prefix_scorer = PREFIX_BLOCKS in decision.scores
        predicted = int(plan.matched_blocks) if has_prefix_scorer else None
        outcome = plan.prefix_outcome
        sampling = SamplingParams(max_tokens=request.num_output_tokens, ignore_eos=True)
        tenant, priority_class = self._tenant_and_class(request)
        try:
            stream.add_request(
                request.request_id, tokens, sampling, wants_remote_kv=prefill is not None,
                tenant=tenant, priority_class=priority_class,
            )  # fmt: skip
        except InvalidRequestError as exc:
            self._free_tokens.pop(request.request_id, None)
            self._fail(request, now_s, "http_400", str(exc))
            return
        self.router.open(WorkerId(stream.worker_id))
        self._inflight[request.request_id] = _InFlight(
            request,
            now_s,
            tokens,
            stream,
            prefill,
            predicted,
            free,
            None if outcome is None else outcome.value,
        )

    def _tenant_and_class(self, request: BenchRequest) -> tuple[str | None, PriorityClass]:
        """Whose share of a worker the request uses and its priority class: the traffic
        here has neither (one shared tenant, every request normal)."""
        return None, PriorityClass.NORMAL

    def _refuse(self, request: BenchRequest, now_s: float, verdict: Verdict) -> None:
        """Admission said no: the client gets its status at once, nothing was placed."""
        detail = f"{verdict.reason}: estimated wait {verdict.estimated_wait_s:.2f} s"
        self._fail(request, now_s, f"http_{verdict.status}", detail)

    def _fail(self, request: BenchRequest, now_s: float, kind: str, detail: str) -> None:
        self.records.append(
            RequestRecord(request.request_id, now_s, now_s, now_s, error=kind, error_detail=detail)
        )

    def _on_step_done(
        self, worker: SimWorker, outputs: list[RequestOutput], kv_events: list[KvEvent]
    ) -> None:
        self.router.apply_kv_events(WorkerId(worker.worker_id), kv_events)
        now_s = self.events.now_s
        for out in outputs:
            flight = self._inflight[out.request_id]
            if out.kv_to_send is not None:  # the prefill half computed its blocks
                delay_s = self.spec.profile.transfer_s(len(out.kv_to_send.block_ids))
                self.events.after(delay_s, partial(self._landed, flight))
                continue
            if worker is not flight.worker:
                continue
            if out.kv_reserved is not None and out.kv_reserved.num_tokens > 0:
                assert flight.prefill is not None
                r = out.kv_reserved
                flight.prefill.add_prefill_request(
                    out.request_id, flight.token_ids, r.first_token, r.end_token
                )
                self.router.open(WorkerId(flight.prefill.worker_id))
            flight.token_times_s.extend([now_s] * len(out.new_tokens))
            if out.finish_reason is not None:
                self._finish(flight, out, now_s)

    def _landed(self, flight: _InFlight) -> None:
        assert flight.prefill is not None
        flight.worker.remote_kv_landed(flight.request.request_id)
        flight.prefill.complete_kv_send(flight.request.request_id)
        self.router.close(WorkerId(flight.prefill.worker_id))

    def _finish(self, flight: _InFlight, out: RequestOutput, now_s: float) -> None:
        request = flight.request
        del self._inflight[request.request_id]
        self._free_tokens.pop(request.request_id, None)
        worker_id = WorkerId(flight.worker.worker_id)
        self.router.close(worker_id)
        self.router.sessions.set(request.session_id, worker_id)
        self.records.append(
            RequestRecord(
                request_id=request.request_id,
                scheduled_s=flight.arrival_s,
                sent_s=flight.arrival_s,
                end_s=now_s,
                token_times_s=tuple(flight.token_times_s),
                num_output_tokens=out.num_output_tokens,
                num_prompt_tokens=out.num_prompt_tokens,
                num_cached_tokens=max(out.num_cached_tokens, flight.free_tokens),
                worker=worker_id,
                predicted_cached_blocks=flight.predicted_blocks,
                prefix_outcome=flight.prefix_outcome,
            )
        )
