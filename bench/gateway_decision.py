"""The gateway benchmark's first part: the routing pipeline's decision time in process
(block hashing, index lookup, scorers, picker) for long prompts over many workers
(bench/gateway_overhead.py)."""

from __future__ import annotations

import random
import time
from typing import Any

from gateway_load import summary_ms
from gateway_procs import MODEL

from kvflow.proto.block_hash import block_hashes, iter_block_hashes, make_hash_seed
from kvflow.proto.roles import Role
from kvflow.router.routing.block_hasher import CachedBlockHasher
from kvflow.router.routing.block_index import BlockIndex
from kvflow.router.routing.pipeline import DEFAULT_WEIGHTS, build_pipeline
from kvflow.router.routing.sessions import SessionTable
from kvflow.router.routing.types import RouteRequest, WorkerId, WorkerView


def decision_benchmark(num_workers: int, prompt_tokens: int, num_decisions: int) -> dict[str, Any]:
    rng = random.Random(0)
    seed, salt, block = make_hash_seed(MODEL), "tenant-a", 16
    index, sessions = BlockIndex(), SessionTable()
    pipeline = build_pipeline(DEFAULT_WEIGHTS, index=index, sessions=sessions, rng=rng)
    hasher = CachedBlockHasher()
    workers = [
        WorkerView(WorkerId(f"10.0.0.{i}:50051"), MODEL, Role.COLOCATED, True,
                   queue_depth=rng.randrange(8), kv_usage=rng.random() / 2)
        for i in range(num_workers)
    ]  # fmt: skip
    # One long document per worker, cached there (as after an earlier request).
    documents = [[rng.randrange(49152) for _ in range(prompt_tokens)] for _ in workers]
    for worker, doc in zip(workers, documents, strict=True):
        index.add(worker.worker_id, block_hashes(doc, block_size=block, seed=seed, salt=salt))
        list(hasher.iter_hashes(doc, block_size=block, seed=seed, salt=salt))
    num_cached = prompt_tokens * 3 // 4

    def prompts(kind: str) -> list[int]:
        doc = rng.choice(documents)
        if kind == "cached":
            return doc
        if kind == "three_quarters_cached":
            return doc[:num_cached] + [
                rng.randrange(49152) for _ in range(prompt_tokens - num_cached)
            ]
        return [rng.randrange(49152) for _ in range(prompt_tokens)]

    results: dict[str, Any] = {"num_workers": num_workers, "prompt_tokens": prompt_tokens}
    for kind in ("cached", "three_quarters_cached", "cold"):
        samples = [prompts(kind) for _ in range(num_decisions)]
        times = []
        for tokens in samples:
            started = time.perf_counter()
            hashes = hasher.iter_hashes(tokens, block_size=block, seed=seed, salt=salt)
            decision = pipeline.route(RouteRequest(MODEL, hashes), workers)
            times.append(time.perf_counter() - started)
            assert decision is not None
        results[kind] = summary_ms(times)
    # The same cached decisions with the chain hashed from scratch each time (no memo).
    times = []
    for _ in range(num_decisions):
        tokens = rng.choice(documents)
        started = time.perf_counter()
        hashes = iter_block_hashes(tokens, block_size=block, seed=seed, salt=salt)
        pipeline.route(RouteRequest(MODEL, hashes), workers)
        times.append(time.perf_counter() - started)
    results["cached_without_hash_memo"] = summary_ms(times)
    return results
