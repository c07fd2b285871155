"""The virtual-time cluster: exact timings, determinism, the real routing pipeline, PD."""

from __future__ import annotations

import random

import pytest

from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.loadgen.workload import BenchRequest, Segment, TextBlock
from kvflow.proto.step_model import StepTiming
from kvflow.router.routing.types import WorkerId
from kvflow.sim.arms import ARMS, resolve_arm
from kvflow.sim.cluster import ClusterSpec, VirtualCluster

TIMING = StepTiming(base_step_s=0.010, per_prefill_token_s=0.001, per_decode_seq_s=0.002)


def profile(num_kv_blocks: int = 4096, **kw: object) -> SimProfile:
    fields: dict[str, object] = dict(name="test", timing=TIMING, block_size=16,
                                     kv_bytes_per_block=16 * 1024, num_kv_blocks=num_kv_blocks,
                                     max_num_batched_tokens=2048, max_num_seqs=64,
                                     kv_link_bytes_per_s=1.6e6, source="test")  # fmt: skip
    fields.update(kw)
    return SimProfile(**fields)  # type: ignore[arg-type]


def request(rid: str, words: int, outputs: int, key: str | None = None) -> BenchRequest:
    block = TextBlock(key or f"text-{rid}", words)
    return BenchRequest(rid, "ns", rid, (Segment("user", (block,)),), outputs)


def run(spec: ClusterSpec, arm: str, schedule: list[tuple[BenchRequest, float]],
        seed: int = 0) -> tuple[VirtualCluster, list[RequestRecord]]:  # fmt: skip
    cluster = VirtualCluster(spec, resolve_arm(arm), seed=seed)
    for req, at_s in schedule:
        cluster.submit(req, at_s)
    return cluster, cluster.run()


def shared_prefix_schedule(
    n: int, rate_per_s: float, seed: int
) -> list[tuple[BenchRequest, float]]:
    workload = SharedPrefixWorkload(num_groups=6, users_per_group=3, prefix_words=(512, 256),
                                    question_words=32, output_tokens=8)  # fmt: skip
    requests = workload.requests(seed=seed, namespace="t")
    return [(next(requests), i / rate_per_s) for i in range(n)]


def test_one_request_costs_exactly_what_the_timing_model_says() -> None:
    _, [record] = run(ClusterSpec(profile(), num_workers=1), "kvflow",
                      [(request("a", 100, 3), 0.5)])  # fmt: skip
    # Prefill of 100 tokens: 10 ms + 100 x 1 ms; each decode: 10 ms + 2 ms.
    assert record.sent_s == 0.5
    assert record.ttft_s == pytest.approx(0.110)
    assert record.tpot_s == pytest.approx(0.012)
    assert record.e2e_s == pytest.approx(0.134)
    assert record.num_output_tokens == 3 and record.num_prompt_tokens == 100
    assert record.worker == "sim-0"


def test_two_requests_at_one_instant_share_a_step() -> None:
    schedule = [(request("a", 100, 2), 0.0), (request("b", 50, 2), 0.0)]
    _, records = run(ClusterSpec(profile(), num_workers=1), "kvflow", schedule)
    # One step of 150 prompt tokens for both: 10 + 150 ms.
    assert [r.ttft_s for r in records] == pytest.approx([0.160, 0.160])


def test_a_run_is_a_function_of_its_seed() -> None:
    spec = ClusterSpec(profile(), num_workers=4)
    first = run(spec, "random", shared_prefix_schedule(120, 40.0, seed=1), seed=7)[1]
    again = run(spec, "random", shared_prefix_schedule(120, 40.0, seed=1), seed=7)[1]
    other = run(spec, "random", shared_prefix_schedule(120, 40.0, seed=1), seed=8)[1]
    assert first == again
    assert [r.worker for r in first] != [r.worker for r in other]


def hit_rate(records: list[RequestRecord]) -> float:
    cached = sum(r.num_cached_tokens or 0 for r in records)
    return cached / sum(r.num_prompt_tokens or 0 for r in records)


def test_the_default_router_finds_the_prefixes_round_robin_scatters() -> None:
    # 4 workers whose caches hold 2 of the 6 prefixes each: round-robin makes every worker
    # see every prefix and evict; the router's index keeps each group on one worker.
    spec = ClusterSpec(profile(num_kv_blocks=96), num_workers=4)
    schedule = shared_prefix_schedule(150, 20.0, seed=2)
    cluster, kvflow = run(spec, "kvflow", schedule)
    _, round_robin = run(spec, "round-robin", schedule)
    _, ideal = run(spec, "ideal", schedule)
    assert hit_rate(kvflow) > 1.5 * hit_rate(round_robin)
    assert hit_rate(ideal) >= hit_rate(kvflow)
    # The router predicted what the workers then served (its index follows their events;
    # the block policy's prefix scorer reports its match per request, the time scorer not).
    _, blocks = run(spec, "kvflow-blocks", schedule)
    predicted = sum(min((r.predicted_cached_blocks or 0) * 16, r.num_prompt_tokens or 0)
                    for r in blocks)  # fmt: skip
    assert predicted == pytest.approx(sum(r.num_cached_tokens or 0 for r in blocks), rel=0.05)
    # After the run the index holds exactly each worker's cached blocks.
    for worker_id, worker in cluster.workers.items():
        cached = worker.engine.kv_cache.pool.cached_hashes()
        matched = cluster.router.index.match_prefix(cached, [worker_id])
        assert cluster.router.index.num_blocks(WorkerId(worker_id)) == len(cached)
        assert matched[worker_id] == len(cached) or not cached


def test_disaggregated_plans_move_kv_at_the_link_bandwidth() -> None:
    # A prefill and a decode worker; a 1024-token prompt lacks 1008 tokens (63 blocks) on
    # the decode worker, over min_remote_prefill_tokens: the router disaggregates.
    spec = ClusterSpec(profile(), num_workers=2, num_prefill_workers=1)
    cluster, [record] = run(spec, "kvflow", [(request("a", 1024, 3), 0.0)])
    prefill_s = 0.010 + 0.001 * 1008  # the prefill worker computes blocks 0-62
    transfer_s = 63 * 16 * 1024 / 1.6e6  # 0.645 s
    first_token_s = 0.010 + 0.001 * 16  # the decode worker computes the last block
    assert record.ttft_s == pytest.approx(prefill_s + transfer_s + first_token_s)
    assert record.worker == "sim-1"
    prefill_worker, decode_worker = cluster.workers.values()
    # Decode: a step that only reserves (no compute, 0 s), the last block, two decodes.
    assert prefill_worker.num_steps == 1 and decode_worker.num_steps == 4
    assert decode_worker.busy_s == pytest.approx(first_token_s + 2 * 0.012)
    assert not prefill_worker.engine.has_unfinished_requests


def test_every_arm_runs() -> None:
    spec = ClusterSpec(profile(num_kv_blocks=256), num_workers=3)
    for arm in ARMS:
        _, records = run(spec, arm, shared_prefix_schedule(30, 30.0, seed=3))
        assert len(records) == 30 and all(r.is_ok for r in records), arm
    with pytest.raises(ValueError, match="unknown arm"):
        resolve_arm("fastest")


def test_an_arm_setting_charges_the_time_scorers_prefill_stall() -> None:
    """``kvflow:prefill_stall=<share>``: the time scorer charges a prefill's stall on the
    sequences decoding beside it (routing/cost.py), so a cold 7,000-token prompt waits
    behind a 1,000-token queue rather than stall two decoding sequences."""
    from kvflow.proto.block_hash import block_hashes, make_hash_seed
    from kvflow.proto.roles import Role
    from kvflow.router.routing.block_index import BlockIndex
    from kvflow.router.routing.placement import PlacementRequest
    from kvflow.router.routing.sessions import SessionTable
    from kvflow.router.routing.types import WorkerView
    from kvflow.sim.cluster import step_costs

    def view(name: str, **kw: int) -> WorkerView:
        return WorkerView(WorkerId(name), "m", Role.COLOCATED, True, 0, 0.0, **kw)

    workers = [view("decoding", num_decode_seqs=2, num_kv_tokens=2000),
               view("queued", num_prefill_tokens=1000)]  # fmt: skip
    hashes = block_hashes(list(range(7000)), block_size=16, seed=make_hash_seed("m"))

    def chosen(arm: str) -> str:
        placement = resolve_arm(arm).build(BlockIndex(), SessionTable(), random.Random(0),
                                           step_costs(profile()))  # fmt: skip
        plan = placement.plan(PlacementRequest("m", hashes, 7000, 16), workers)
        assert plan is not None
        return plan.stream_worker

    assert chosen("kvflow") == "decoding"
    assert chosen("kvflow:prefill_stall=1") == "queued"
    with pytest.raises(ValueError, match="prefill_stall"):
        resolve_arm("kvflow:prefill_stall=-1")
