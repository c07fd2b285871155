"""Prometheus metrics of one worker, named ``kvflow_worker_<what>_<unit>``.

Observed on the engine thread after every step. TTFT, TPOT and ITL are histograms with
buckets from 1 ms to 60 s: a CPU worker's TTFT is seconds, a GPU worker's tens of ms.

The request families the planner reads (kvflow.proto.metric_names.CLASS_FAMILIES) carry a
``priority_class`` label, every class's series present from the start: the planner sizes
for the online classes and drops batch's (docs/planner.md, "Batch work").
"""

from __future__ import annotations

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from kvflow.engine_worker.class_load import class_loads, kv_share
from kvflow.engine_worker.core.engine import Engine, RequestOutput
from kvflow.engine_worker.loop_records import TransferRecord
from kvflow.engine_worker.memory.device_memory import DeviceMemoryProbe
from kvflow.engine_worker.memory.report import MemoryReport
from kvflow.proto import metric_names as names
from kvflow.proto.priority_class import PriorityClass

LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.5,
    0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 20.0, 40.0, 60.0,
)  # fmt: skip

REJECT_REASONS = ("queue_full", "queue_time")


class WorkerMetrics:
    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        r = self.registry
        p = "kvflow_worker_"
        by_class = [names.CLASS_LABEL]
        self.waiting = Gauge(
            names.WORKER_WAITING, "Requests queued for admission", by_class, registry=r
        )
        self.running = Gauge(
            names.WORKER_RUNNING, "Requests holding KV blocks", by_class, registry=r
        )
        self.kv_usage = Gauge(names.WORKER_KV_USAGE, "Fraction of KV blocks in use", registry=r)
        self.kv_class_usage = Gauge(
            names.WORKER_KV_CLASS_USAGE,
            "Fraction of KV blocks the class's requests hold (a shared block counts per holder)",
            by_class,
            registry=r,
        )
        self.cached_blocks = Gauge(
            p + "prefix_cache_blocks", "Blocks in the prefix cache", registry=r
        )
        self.hit_rate = Gauge(
            p + "prefix_cache_hit_ratio", "Prompt tokens served from cache / looked up", registry=r
        )
        self.queried = Counter(
            p + "prefix_cache_queried_tokens", "Prompt tokens looked up in the cache", registry=r
        )
        self.hits = Counter(
            p + "prefix_cache_hit_tokens", "Prompt tokens found in the cache", registry=r
        )
        self.prompt_tokens = Counter(
            names.WORKER_PROMPT_TOKENS, "Prompt tokens of finished requests", by_class, registry=r
        )
        self.generation_tokens = Counter(
            names.WORKER_GENERATION_TOKENS, "Tokens generated", by_class, registry=r
        )
        self.finished = Counter(
            names.WORKER_FINISHED,
            "Finished requests",
            ["finish_reason", names.CLASS_LABEL],
            registry=r,
        )
        self.preemptions = Counter(
            p + "preemptions", "Requests preempted to free blocks", registry=r
        )
        # By the victim's class: a realtime request preempts batch work before its own class,
        # so batch preemptions rising while realtime ones stay at zero is the design working.
        self.class_preemptions = Counter(
            p + "class_preemptions",
            "Requests preempted to free blocks or a seat, by the preempted request's class",
            ["victim_class"],
            registry=r,
        )
        self._seen_class_preemptions = dict.fromkeys(PriorityClass, 0)
        for cls in PriorityClass:
            self.class_preemptions.labels(cls.value)
        self.ttft = Histogram(
            names.WORKER_TTFT,
            "Arrival to first token",
            by_class,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.tpot = Histogram(
            names.WORKER_TPOT,
            "(last token - first token) / (output tokens - 1)",
            by_class,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.itl = Histogram(
            p + "inter_token_latency_seconds",
            "Time between tokens",
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.queue_wait = Histogram(
            names.WORKER_QUEUE_WAIT,
            "Arrival to first scheduled (the wait before a prompt's first chunk), per request",
            by_class,
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.step_duration = Histogram(
            p + "step_duration_seconds", "One engine step", buckets=LATENCY_BUCKETS_S, registry=r
        )
        self.kv_transfers = Counter(
            p + "kv_transfers",
            "PD KV transfers by direction (send, receive) and outcome (ok, or why not)",
            ["direction", "outcome"],
            registry=r,
        )
        self.kv_transfer_bytes = Counter(
            p + "kv_transfer_bytes", "KV bytes moved by PD transfers", ["direction"], registry=r
        )
        self.kv_transfer_duration = Histogram(
            p + "kv_transfer_duration_seconds",
            "A send (gather to ack) or a receive (reservation to landed)",
            ["direction"],
            buckets=LATENCY_BUCKETS_S,
            registry=r,
        )
        self.kv_transfers_in_flight = Gauge(
            p + "kv_transfers_in_flight",
            "Requests waiting for remote KV or holding blocks until sent",
            registry=r,
        )
        self.rejected = Counter(
            p + "requests_rejected",
            "Generate and Prefill calls refused before queueing (RESOURCE_EXHAUSTED): the "
            "queue at --max-waiting-requests (queue_full) or the estimated wait over "
            "--max-queue-time-s (queue_time)",
            ["reason"],
            registry=r,
        )
        for reason in REJECT_REASONS:
            self.rejected.labels(reason)
        # What the worker holds, set once at start (memory/report.py). Capacity in tokens is
        # what routers and planners compare across workers of different KV dtypes.
        self.weight_bytes = Gauge(
            p + "weight_bytes", "Bytes of the model's weights, by tensor dtype", ["dtype"],
            registry=r,
        )  # fmt: skip
        self.kv_cache_bytes = Gauge(
            p + "kv_cache_bytes", "Bytes of the paged KV cache, by KV dtype", ["dtype"],
            registry=r,
        )  # fmt: skip
        self.kv_cache_blocks = Gauge(p + "kv_cache_blocks", "Blocks of the KV cache", registry=r)
        self.kv_cache_tokens = Gauge(
            p + "kv_cache_tokens", "Tokens the KV cache holds (blocks x block size)", registry=r
        )
        # The device's memory by part, read at each scrape (memory/device_memory.py): next
        # to DCGM's whole-device figure it says what of a full GPU is the worker's own.
        self.device_memory = Gauge(
            p + "device_memory_bytes",
            "Device memory by part: weights, kv_cache, cuda_graphs, other (the rest of "
            "torch's allocator; CUDA only)",
            ["part"],
            registry=r,
        )
        for cls in PriorityClass:  # every class's series from the start: absent is not zero
            for family in (
                self.waiting,
                self.running,
                self.kv_class_usage,
                self.prompt_tokens,
                self.generation_tokens,
                self.ttft,
                self.tpot,
                self.queue_wait,
            ):
                family.labels(cls.value)  # fmt: skip
        self._last_token_time_s: dict[str, float] = {}
        self._last_step_time_s: float | None = None
        self._seen_queried = 0
        self._seen_hits = 0

    def observe_memory(self, memory: MemoryReport, device: str = "cpu") -> None:
        """``device``: the worker's --device (cpu, cuda, cuda:N)."""
        probe = DeviceMemoryProbe(memory, torch.device(device))
        for part in probe.parts:
            self.device_memory.labels(part).set_function(probe.reader(part))
        for dtype, num_bytes in memory.weight_bytes.items():
            self.weight_bytes.labels(dtype).set(num_bytes)
        self.kv_cache_bytes.labels(memory.kv_cache_dtype).set(memory.kv_cache_bytes)
        self.kv_cache_blocks.set(memory.num_blocks)
        self.kv_cache_tokens.set(memory.num_tokens)

    def observe_step(self, engine: Engine, outputs: list[RequestOutput], now_s: float) -> None:
        kv = engine.kv_cache
        for cls, load in class_loads(engine).items():
            self.waiting.labels(cls.value).set(load.num_waiting)
            self.running.labels(cls.value).set(load.num_running)
            self.kv_class_usage.labels(cls.value).set(kv_share(load, kv.num_total_blocks))
        self.kv_usage.set(kv.pool.usage)
        self.cached_blocks.set(kv.pool.num_cached_blocks)
        self.hit_rate.set(kv.stats.hit_rate)
        self.kv_transfers_in_flight.set(engine.scheduler.num_kv_transfers)
        self.queried.inc(kv.stats.num_queried_tokens - self._seen_queried)
        self.hits.inc(kv.stats.num_hit_tokens - self._seen_hits)
        self._seen_queried, self._seen_hits = kv.stats.num_queried_tokens, kv.stats.num_hit_tokens
        for cls, count in engine.scheduler.preemptions_by_class.items():
            self.class_preemptions.labels(cls.value).inc(count - self._seen_class_preemptions[cls])
            self._seen_class_preemptions[cls] = count
        if outputs and self._last_step_time_s is not None:
            self.step_duration.observe(now_s - self._last_step_time_s)
        self._last_step_time_s = now_s if engine.has_unfinished_requests else None

        for out in outputs:
            if not out.new_tokens and out.finish_reason is None:
                continue  # a PD handoff (blocks reserved or ready to send), not a token
            request = engine.requests.get(out.request_id)
            # A finished request has left the engine; its output carries its class.
            word = (out.priority_class if request is None else request.priority_class).value
            self.generation_tokens.labels(word).inc(len(out.new_tokens))
            last = self._last_token_time_s.get(out.request_id)
            if last is not None and out.new_tokens:
                self.itl.observe(now_s - last)
            self._last_token_time_s[out.request_id] = now_s
            if out.finish_reason is None:
                continue
            del self._last_token_time_s[out.request_id]
            if out.stop_token_id is not None:
                self.generation_tokens.labels(word).inc()
            self.finished.labels(out.finish_reason.value, word).inc()
            self.prompt_tokens.labels(word).inc(out.num_prompt_tokens)
            timings = out.timings
            if timings is None:
                continue
            self.preemptions.inc(timings.num_preemptions)
            self.queue_wait.labels(word).observe(timings.queued_s)
            if out.num_output_tokens >= 1:
                self.ttft.labels(word).observe(timings.ttft_s)
            if out.num_output_tokens >= 2:
                decode_s = timings.e2e_s - timings.ttft_s
                self.tpot.labels(word).observe(decode_s / (out.num_output_tokens - 1))

    def observe_transfer(self, record: TransferRecord) -> None:
        """Called from transfer threads; prometheus_client's metrics are thread-safe."""
        self.kv_transfers.labels(record.direction, record.outcome).inc()
        if record.outcome == "ok":
            self.kv_transfer_bytes.labels(record.direction).inc(record.num_bytes)
            self.kv_transfer_duration.labels(record.direction).observe(record.seconds)
