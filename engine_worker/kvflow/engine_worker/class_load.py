"""A worker's load by priority class, now: requests waiting and running, and KV blocks held.

The metrics export it per class (kvflow.proto.metric_names.CLASS_FAMILIES) so the
operator's planner can size for the online classes alone: a batch queued behind online work
is spare capacity used, not a lack of replicas. The simulator's planner reads the same
figures from its engines (kvflow.sim.autoscale_observe). Pure: one pass over the engine's
requests, O(requests) per call, cheap enough for every step.
"""

from __future__ import annotations

from dataclasses import dataclass

from kvflow.engine_worker.core.engine import Engine
from kvflow.proto.priority_class import PriorityClass


@dataclass(frozen=True)
class ClassLoad:
    num_waiting: int  # queued for admission (preempted ones included)
    num_running: int  # holding KV blocks and scheduled
    num_kv_blocks: int  # blocks its requests hold; a block two requests share counts twice


def class_loads(engine: Engine) -> dict[PriorityClass, ClassLoad]:
    """Every class, those with no request at zero."""
    scheduler, kv = engine.scheduler, engine.kv_cache
    waiting = scheduler.waiting.num_waiting_by_rank
    running = dict.fromkeys(PriorityClass, 0)
    for request in scheduler.running:
        running[request.priority_class] += 1
    blocks = dict.fromkeys(PriorityClass, 0)
    for request in engine.requests.values():
        blocks[request.priority_class] += kv.num_blocks_held(request.request_id)
    return {cls: ClassLoad(waiting[cls.rank], running[cls], blocks[cls]) for cls in PriorityClass}


def kv_share(load: ClassLoad, num_total_blocks: int) -> float:
    """The share of the cache the class holds, at most 1 (shared blocks count per holder)."""
    return min(1.0, load.num_kv_blocks / num_total_blocks) if num_total_blocks else 0.0
