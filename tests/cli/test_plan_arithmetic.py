"""`kvflow plan`'s core against hand-computed cases (the arithmetic is in the comments)."""

from __future__ import annotations

import pytest

from kvflow.cli.plan.capacity import load_model
from kvflow.cli.plan.deployment import Deployment
from kvflow.cli.plan.gpus import BUILTIN, GpuOffer
from kvflow.cli.plan.memory import memory_plan
from kvflow.cli.plan.models import from_flags, preset
from kvflow.cli.plan.plan import PlanInputs, make_plan
from kvflow.cli.plan.steps import roofline
from kvflow.cli.plan.workload import Slo, Target, make_workload, workload
from kvflow.engine_worker.sim.hardware import GB, GpuSpec
from kvflow.engine_worker.sim.profiles import Efficiency

approx = pytest.approx

# A GPU with round numbers: 100 GB, 1,000 GB/s, 100 TFLOPS, $2 an hour.
ROUND = GpuOffer("round", GpuSpec("Round", 100e12, 1000 * GB, 100 * GB, 1e9), 2.0)
# Half of bandwidth and FLOPS reached, no fixed costs, vLLM's 90 % and 2 GB per GPU.
EFF = Efficiency(memory=0.5, compute=0.5, step_overhead_s=0.0, per_seq_overhead_s=0.0)
# 10 B parameters, 10 layers of 8 heads (all KV heads, no GQA) of 100 dimensions.
MODEL = from_flags(params_b=10, num_layers=10, num_heads=8, num_kv_heads=8, head_dim=100,
                   max_context_tokens=None)  # fmt: skip


def deployment(**changes: object) -> Deployment:
    fields: dict[str, object] = dict(
        gpu=ROUND, tp=1, weight_dtype="bf16", weight_bytes_per_param=2, kv_dtype="bf16",
        kv_bytes_per_value=2, eff=EFF, redundancy_replicas=1,
    )  # fmt: skip
    fields.update(changes)
    return Deployment(**fields)  # type: ignore[arg-type]


def test_memory_of_the_round_case() -> None:
    mem = memory_plan(MODEL, workload(1000, 1000), deployment())
    assert mem.weight_bytes == 20e9  # 10e9 params x 2 bytes
    assert mem.usable_bytes == approx(90e9)  # 100 GB x 0.9
    assert mem.kv_pool_bytes == approx(68e9)  # 90 - 20 - 2 GB
    assert mem.kv_bytes_per_token == 32_000  # 2 x 10 layers x 8 KV heads x 100 x 2 bytes
    assert mem.kv_bytes_per_request == 64e6  # (1000 + 1000) tokens x 32,000
    assert mem.kv_capacity_tokens == 2_125_000  # 68e9 / 32,000
    assert mem.max_concurrency == 1062  # floor(68e9 / 64e6 = 1062.5)


def test_step_times_of_the_round_case() -> None:
    steps = roofline(MODEL, deployment(), ref_context_tokens=500)
    t = steps.timing
    assert t.base_step_s == approx(0.040)  # 20e9 weight bytes / (1000 GB/s x 0.5)
    assert t.per_decode_seq_s == approx(0.4e-3)  # 2 x 10e9 FLOPs / (100 TFLOPS x 0.5)
    assert t.per_kv_token_s == approx(64e-9)  # 32,000 bytes / 500 GB/s
    # (20e9 + 4 x 10 layers x 8 heads x 100 x 500 context = 16e6) FLOPs / 50e12
    assert t.per_prefill_token_s == approx(400.32e-6)
    assert steps.prefill_s(1000) == approx(0.040 + 1000 * 400.32e-6)  # one chunk: 440.32 ms
    # A 2,000-token prompt attends to 1,000 earlier tokens on average, 500 more than the
    # reference: + 32,000 x 500 / 50e12 = 0.32 us per token.
    assert steps.prefill_work_s(2000) == approx(2000 * (400.32e-6 + 0.32e-6))


def test_latency_is_linear_in_the_batch() -> None:
    work = workload(1000, 1000)
    load = load_model(roofline(MODEL, deployment(), 500), work)
    # A decoding sequence: 0.4 ms of matmuls + 64 ns x 1,500 tokens of KV read (1,000 in
    # + half of 1,000 out) = 0.496 ms; its share of the prompts that join: 400.32 ms of
    # prefill per 1,000 output tokens = 0.40032 ms. TPOT(B) = 40 ms + 0.89632 ms x B.
    assert load.tpot.base_s == approx(0.040)
    assert load.tpot.per_seq_s == approx(0.89632e-3)
    # TTFT(B) = TPOT(B) + 440.32 ms of prefill + one chunk x 0.496 ms x B
    assert load.ttft_longest.base_s == approx(0.48032)
    assert load.ttft_longest.per_seq_s == approx(1.39232e-3)
    # A request lasts TTFT + 1,000 x TPOT = 40.48032 s + 0.89771232 s x B.
    assert load.duration.base_s == approx(40.48032)
    assert load.duration.per_seq_s == approx(0.89771232)


def _round_plan(target: Target) -> PlanInputs:
    return PlanInputs(
        MODEL, workload(1000, 1000), deployment(), target, Slo(ttft_s=1.0, tpot_s=0.100)
    )


def test_a_concurrency_target_sized_by_the_slo() -> None:
    plan = make_plan(_round_plan(Target(concurrency=500)))
    # TPOT <= 100 ms: B <= (100 - 40) / 0.89632 = 66.9; TTFT <= 1 s: (1000 - 480.32) /
    # 1.39232 = 373.2. Limits: memory 1062, throughput (max_num_seqs) 256, slo 66.
    assert plan.replica.batch_limits == {"memory": 1062, "throughput": 256, "slo": 66}
    assert plan.replica.binding == "slo"
    assert plan.replica.tpot_s == approx(0.040 + 66 * 0.89632e-3)  # 99.16 ms
    fleet = plan.fleet
    # 500 requests: ceil(500/1062) = 1, ceil(500/256) = 2, ceil(500/66) = 8; one spare.
    assert fleet.replicas_by_constraint == {"memory": 1, "throughput": 2, "slo": 8}
    assert (fleet.replicas_for_load, fleet.num_replicas, fleet.num_gpus) == (8, 9, 9)
    assert fleet.batch_per_replica == 62.5
    assert fleet.tpot_s == approx(0.040 + 62.5 * 0.89632e-3)  # 96.02 ms
    # 500 requests of 40.48032 + 62.5 x 0.89771232 = 96.58734 s: 5.1766 req/s, x 1,000
    # output tokens; 9 GPUs x $2 = $18 an hour; 18 / (5,176.6 x 3,600) x 1e6 = $0.9659.
    assert fleet.output_tokens_per_s == approx(500 / 96.58734 * 1000)
    assert fleet.total_tokens_per_s == approx(2 * fleet.output_tokens_per_s)
    assert fleet.cost_per_hour == 18.0
    assert fleet.cost_per_million_output_tokens == approx(0.9659, rel=1e-4)


def test_a_rate_target() -> None:
    plan = make_plan(_round_plan(Target(rate_per_s=2.0)))
    # A replica at batch B serves B / (40.48032 + 0.89771232 B) requests/s:
    # slo 66 -> 0.66179 (2 / 0.66179 = 3.02: 4), throughput 256 -> 0.94713 (3),
    # memory 1062 -> 1.0686 (2).
    assert plan.fleet.replicas_by_constraint == {"memory": 2, "throughput": 3, "slo": 4}
    # Each of 4 replicas gets 0.5 req/s and settles where B = 0.5 x D(B):
    # 0.5 x 40.48032 / (1 - 0.5 x 0.89771232) = 36.724.
    assert plan.fleet.batch_per_replica == approx(36.724, rel=1e-4)
    assert plan.fleet.output_tokens_per_s == approx(2.0 * 1000)


def test_a_mix_weights_prompts_per_request_and_contexts_per_step() -> None:
    # 3 requests of 100 in / 100 out for each of 1,000 in / 300 out.
    work = make_workload([(100, 100, 3), (1000, 300, 1)])
    assert work.mean_input_tokens == 325  # (3 x 100 + 1000) / 4
    assert work.mean_output_tokens == 150  # (3 x 100 + 300) / 4
    # Steps in the batch: 3 x 100 = 300 short, 300 long. Held: (300 x 200 + 300 x 1300)
    # / 600 = 750; read: (300 x 150 + 300 x 1150) / 600 = 650.
    assert work.held_context_tokens == 750
    assert work.read_context_tokens == 650
    assert work.max_context_tokens == 1300


def test_tensor_parallelism_splits_weights_and_keeps_85_percent() -> None:
    model = preset("llama-3-70b")
    assert model is not None
    dep = deployment(gpu=BUILTIN["h100"], tp=4, eff=Efficiency())
    mem = memory_plan(model, workload(1024, 256), dep)
    # 4 x 80 GB x 0.9 = 288 GB - 141.11 GB - 4 x 2 GB = 138.89 GB of KV.
    assert mem.kv_pool_bytes == approx(288e9 - model.num_params * 2 - 8e9)
    # Bandwidth 4 x 0.85 x 0.8 x 3.35 TB/s = 9.112 TB/s; 139.5 GB of matmul weights.
    t = roofline(model, dep, 512).timing
    assert t.base_step_s == approx(model.num_matmul_params * 2 / 9.112e12 + 1e-3)
