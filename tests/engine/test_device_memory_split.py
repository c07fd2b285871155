"""The device memory split's arithmetic (memory/device_memory.py), on allocator snapshots
shaped as torch's: CUDA-graph pools are the segments outside torch's default pool, and
``other`` is what the allocator holds beyond weights, KV cache and graphs."""

from __future__ import annotations

from kvflow.engine_worker.memory.device_memory import graph_pool_bytes, split

MIB = 2**20


def segment(device: int, pool: tuple[int, int], mib: int) -> dict[str, object]:
    return {"device": device, "segment_pool_id": pool, "total_size": mib * MIB}


def test_graph_pools_are_the_private_pools_of_this_device() -> None:
    segments = [
        segment(0, (0, 0), 500),  # torch's own pool: weights, cache, activations
        segment(0, (1, 0), 40),  # a captured graph's private pool
        segment(0, (2, 0), 24),
        segment(1, (1, 0), 99),  # another device's graph
    ]
    assert graph_pool_bytes(segments, 0) == 64 * MIB
    assert graph_pool_bytes(segments, 1) == 99 * MIB
    assert graph_pool_bytes([], 0) == 0


def test_other_is_the_allocators_rest_and_never_negative() -> None:
    parts = split(weight_bytes=300, kv_cache_bytes=500, graph_bytes=64, reserved_bytes=1000)
    assert parts == {"weights": 300, "kv_cache": 500, "cuda_graphs": 64, "other": 136}
    # Weights the allocator never saw (mapped from a file) leave nothing negative.
    assert split(900, 500, 0, 1000)["other"] == 0
    # The CPU: no allocator to split.
    assert split(300, 500, 0, None) == {"weights": 300, "kv_cache": 500, "cuda_graphs": 0}
