"""What a metrics scrape of the elastic cluster gives, as the planner's Observation.

The operator's scrape reads histograms and gauges; here the same figures come from the
virtual cluster's own logs over the last `window_s`:

- request rate and mean prompt tokens from the arrivals (the router counts them; those
  admission control refused included, as the operator adds the routers' rejections);
- TTFT at the percentile from the first tokens in the window, and its violation share
  from them and the refused requests (no first token: over the target), with the share
  refused;
- TPOT at the percentile, its violation share and the mean output tokens from the
  requests that ended in it (a request's TPOT is known at its end);
- the prefill queue wait: the mean `Timings.queued_s` of the requests whose first token
  came in it (what workers export as kvflow_worker_queue_wait_seconds);
- running requests per worker, queued requests (per worker, and in all) and KV usage from
  the workers' last Load answers (gauges, now), less what the batch class holds now
  (`_OnlineLoad`), as the operator reads the workers' series of the online classes only.

Every log the cluster keeps for it counts the online classes only (autoscale_cluster).
"""

from __future__ import annotations

import bisect
import math
from collections.abc import Sequence

from kvflow.engine_worker.class_load import ClassLoad, class_loads, kv_share
from kvflow.operator.planner import Observation
from kvflow.proto.priority_class import PriorityClass
from kvflow.sim.autoscale_cluster import ElasticCluster, Finished
from kvflow.sim.autoscale_policies import PoolSample
from kvflow.sim.worker import SimWorker


def percentile(values: Sequence[float], pct: float) -> float | None:
    """Nearest rank: the smallest value with at least pct % of the values at or below it."""
    if not values:
        return None
    ordered = sorted(values)
    return ordered[max(0, math.ceil(pct / 100 * len(ordered)) - 1)]


class _OnlineLoad:
    """A worker's Load answer less its batch requests: waiting, running and KV usage."""

    def __init__(self, worker: SimWorker, counts_batch: bool) -> None:
        load, engine = worker.load, worker.engine
        batch = class_loads(engine)[PriorityClass.BATCH]
        if counts_batch:
            batch = ClassLoad(0, 0, 0)
        # The Load answer is as of the last step's end, the engine's classes as of now: a
        # request added since can make the difference negative by one.
        self.num_waiting = max(0, load.num_waiting - batch.num_waiting)
        self.num_running = max(0, load.num_running - batch.num_running)
        share = kv_share(batch, engine.kv_cache.num_total_blocks)
        self.kv_usage = max(0.0, load.kv_usage - share)


def _time(entry: tuple[float, float] | tuple[float, int]) -> float:
    return entry[0]


def _end(finished: Finished) -> float:
    return finished.end_s


def sample(
    cluster: ElasticCluster,
    *,
    window_s: float,
    percentile_pct: float,
    ttft_target_s: float,
    tpot_target_s: float,
) -> PoolSample:
    now = cluster.events.now_s
    start = now - window_s
    arrivals = cluster.arrivals[bisect.bisect_right(cluster.arrivals, start, key=_time) :]
    first_tokens = cluster.first_tokens
    firsts = [t for _, t in first_tokens[bisect.bisect_right(first_tokens, start, key=_time) :]]
    ends = cluster.finished[bisect.bisect_right(cluster.finished, start, key=_end) :]
    tpots = [f.record.tpot_s for f in ends if f.record.tpot_s is not None]
    waits = cluster.queue_waits
    queued = [q for _, q in waits[bisect.bisect_right(waits, start, key=_time) :]]
    refused = len(cluster.refusals) - bisect.bisect_right(cluster.refusals, start)
    late = sum(t > ttft_target_s for t in firsts) + refused
    ready = cluster.ready_workers()
    loads = [_OnlineLoad(w, cluster.counts_batch) for w in ready]
    rate = len(arrivals) / window_s
    obs = Observation(
        time_s=now,
        desired_replicas=cluster.num_desired,
        ready_replicas=len(ready),
        pending_replicas=cluster.num_starting,
        request_rate_per_s=rate,
        mean_input_tokens=sum(n for _, n in arrivals) / len(arrivals) if arrivals else None,
        mean_output_tokens=(
            sum(f.record.num_output_tokens for f in ends) / len(ends) if ends else None
        ),
        ttft_s=percentile(firsts, percentile_pct),
        tpot_s=percentile(tpots, percentile_pct),
        ttft_violation_fraction=late / (len(firsts) + refused) if firsts or refused else None,
        tpot_violation_fraction=(
            sum(t > tpot_target_s for t in tpots) / len(tpots) if tpots else None
        ),
        prefill_queue_wait_s=sum(queued) / len(queued) if queued else (0.0 if not rate else None),
        decode_batch_size=sum(x.num_running for x in loads) / len(loads) if loads else None,
        kv_usage=sum(x.kv_usage for x in loads) / len(loads) if loads else None,
        num_waiting_requests=sum(x.num_waiting for x in loads) if loads else None,
        shed_fraction=refused / len(arrivals) if arrivals else None,
    )
    waiting = sum(x.num_waiting for x in loads) / len(loads) if loads else None
    return PoolSample(obs, num_waiting_per_replica=waiting, kv_usage=obs.kv_usage)
