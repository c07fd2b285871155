"""`kvflow plan --disaggregated`: a prefill pool sized by TTFT, a decode pool by TPOT, and the
colocated plan saying when prefill interference is what binds.

The sizing guides' 70B example: 4 x H100 per replica (TP 4), 20 GB of overhead (5 GB per
GPU), 8K context (7,692 prompt + 500 output tokens), 30 concurrent streams, 60 % of the
memory bandwidth and 40 % MFU.
"""

from __future__ import annotations

import json
import math
from dataclasses import replace
from io import StringIO

import pytest

from kvflow.cli.plan.cli import build_parser, inputs_from_args, main
from kvflow.cli.plan.disagg import (
    decode_only_tpot,
    disagg_plan,
    max_utilization,
    mdl_wait_s,
    prefill_service_s,
)
from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.memory import memory_plan
from kvflow.cli.plan.plan import PlanInputs, make_plan
from kvflow.cli.plan.steps import bandwidth_floor_step_s, compute_floor_prefill_s
from kvflow.cli.plan.workload import Slo, Target

GUIDE_70B = ["--gpu", "h100", "--tp", "4", "--input-tokens", "7692", "--output-tokens", "500",
             "--overhead-gb", "5", "--bandwidth-efficiency", "0.6", "--mfu", "0.4"]  # fmt: skip
# The guide's model: 70 B parameters, every one multiplied per token; Llama-3-70B's shape.
GUIDE_MODEL = ["--params-b", "70", "--layers", "80", "--heads", "64", "--kv-heads", "8",
               "--head-dim", "128"]  # fmt: skip
MiB = 1024**2


def inputs(*argv: str) -> PlanInputs:
    return inputs_from_args(build_parser().parse_args(list(argv)))


def test_the_guides_70b_figures() -> None:
    i = inputs(*GUIDE_MODEL, *GUIDE_70B, "--concurrency", "30")
    mem = memory_plan(i.model, i.work, i.dep)
    # 2 (K, V) x 80 layers x 8 KV heads x 128 dims x 2 bytes.
    assert mem.kv_bytes_per_token == 327_680
    # 8,192 tokens x 327,680 bytes = 2,560 MiB per request.
    assert mem.kv_bytes_per_request == 2_560 * MiB
    # (4 x 80 GB x 0.9 - 140 GB of weights - 4 x 5 GB) / 2,560 MiB = 47.7: 47 fit.
    assert mem.max_concurrency == 47
    # A decode step of 30 streams streams 140 GB of weights and 30 x 2,560 MiB of KV:
    # 220.5 GB / (4 x 3.35 TB/s) = 16.46 ms (the guide's 16.4), 27 ms at 60 % of the
    # bandwidth, 1,100 tokens/s.
    floor_s = bandwidth_floor_step_s(i.model, i.dep, 30, 8192)
    assert 16.4 <= floor_s * 1e3 < 16.5
    assert round(floor_s / 0.6 * 1e3) == 27
    assert 1_090 < 30 / (floor_s / 0.6) < 1_110
    # An 8K prompt: 2 x 70e9 x 8,192 FLOPs / (4 x 989 TFLOPS x 40 %) = 0.72 s.
    assert round(compute_floor_prefill_s(i.model, i.dep, 8192), 2) == 0.72


def test_colocated_plan_says_prefill_interference_binds() -> None:
    plan = make_plan(inputs("--model", "llama-3-70b", *GUIDE_70B, "--concurrency", "30",
                            "--tpot-ms", "50"))  # fmt: skip
    # Colocated, every step carries 7,692 / 500 prompt tokens per stream: the SLO binds
    # at 13 and 30 streams need 3 replicas.
    assert (plan.replica.binding, plan.replica.max_batch) == ("slo", 13)
    assert plan.fleet.num_replicas == 3
    x = plan.interference
    assert x is not None and x.batch == 13
    # The prompts' prefill is the larger part of the 50 ms step...
    assert x.prefill_share_s > 0.4 * x.step_s
    # ...and the same step without it meets 50 ms far past 30 streams.
    assert x.decode_only_batch > 30
    decode_only = decode_only_tpot(plan.steps, plan.inputs.work)
    assert decode_only.at(x.decode_only_batch) <= 0.050 < decode_only.at(x.decode_only_batch + 1)
    assert plan.disagg is None  # not asked for


def test_no_interference_note_when_memory_binds() -> None:
    plan = make_plan(inputs("--model", "llama-3-70b", *GUIDE_70B, "--tpot-ms", "500"))
    assert plan.replica.binding == "memory"
    assert plan.interference is None


def test_disaggregated_decode_pool_carries_the_30_streams_on_one_replica() -> None:
    plan = make_plan(inputs("--model", "llama-3-70b", *GUIDE_70B, "--concurrency", "30",
                            "--tpot-ms", "50", "--disaggregated"))  # fmt: skip
    d = plan.disagg
    assert d is not None
    # Decode-only, memory (47) binds before the TPOT SLO: one replica for 30 streams.
    assert d.decode.bound_by == "memory" and d.decode.max_batch == 47
    assert d.decode.replicas == 1 and d.decode.batch_per_replica == 30
    tpot = decode_only_tpot(plan.steps, plan.inputs.work)
    assert d.decode.tpot_s == pytest.approx(tpot.at(30))
    # The rate those streams make: 30 / (500 x TPOT).
    assert d.requests_per_s == pytest.approx(30 / (500 * tpot.at(30)))
    # Prefill: each replica serves 1 / S prompts per second; the pool covers the rate.
    service_s = prefill_service_s(plan.steps, plan.inputs.work)
    assert d.prefill.replicas == math.ceil(d.requests_per_s * service_s)
    assert d.num_gpus == 4 * (d.prefill.replicas + d.decode.replicas)
    assert d.ratio == f"{d.prefill.replicas}P1D"


def test_prefill_pool_grows_to_meet_a_tighter_ttft() -> None:
    base = ("--model", "llama-3-70b", *GUIDE_70B, "--rate", "4", "--disaggregated")
    loose = make_plan(inputs(*base, "--ttft-ms", "5000")).disagg
    tight = make_plan(inputs(*base, "--ttft-ms", "1500")).disagg
    assert loose is not None and tight is not None
    assert tight.prefill.bound_by == "ttft"
    assert tight.prefill.replicas > loose.prefill.replicas
    for pool, slo_s in ((loose.prefill, 5.0), (tight.prefill, 1.5)):
        assert pool.ttft_s <= slo_s + 1e-9
        assert pool.utilization <= pool.max_utilization + 1e-9
    # The decode side does not care about TTFT.
    assert tight.decode == loose.decode


def test_rate_target_sizes_both_pools_from_the_rate() -> None:
    base = ("--model", "llama-3-8b", "--gpu", "h100", "--disaggregated", "--tpot-ms", "30")
    for rate in (10, 100, 400):
        plan = make_plan(inputs(*base, "--rate", str(rate)))
        d = plan.disagg
        assert d is not None and d.requests_per_s == rate
        # Prefill: no TTFT SLO, so replicas run up to fully busy.
        service_s = prefill_service_s(plan.steps, plan.inputs.work)
        assert d.prefill.replicas == math.ceil(rate * service_s)
        # Decode: each replica at most at its SLO batch, B / (256 x TPOT(B)) requests/s.
        tpot = decode_only_tpot(plan.steps, plan.inputs.work)
        per_replica = d.decode.max_batch / (256 * tpot.at(d.decode.max_batch))
        assert d.decode.replicas == math.ceil(rate / per_replica)
        assert d.decode.tpot_s <= 0.030
        # The batch each replica settles at carries its share of the rate.
        b = d.decode.batch_per_replica
        assert b / (256 * tpot.at(b)) == pytest.approx(rate / d.decode.replicas)


def test_mdl_wait_and_its_inverse() -> None:
    # M/D/1: at 50 % busy a prompt waits half a service time / 2 = S / 2 x 0.5 / 0.5.
    assert mdl_wait_s(0.5, 2.0) == pytest.approx(1.0)
    assert mdl_wait_s(1.0, 2.0) == math.inf
    for slack_s, service_s in ((0.1, 1.0), (3.0, 0.5), (1.0, 1.0)):
        rho = max_utilization(slack_s, service_s)
        assert 0 < rho < 1
        assert mdl_wait_s(rho, service_s) == pytest.approx(slack_s)
    assert max_utilization(0.0, 1.0) == 0.0


def test_unreachable_slos_say_what_to_change() -> None:
    i = inputs("--model", "llama-3-70b", *GUIDE_70B, "--disaggregated")
    # Colocated, the longest prompt's first token comes in 898 ms; disaggregated it also
    # moves 2.5 GB of KV (101 ms at 25 GB/s), which misses 950 ms.
    assert make_plan(replace(i, disaggregated=False, slo=Slo(ttft_s=0.95))).replica.ttft_s < 0.95
    with pytest.raises(PlanError, match="--kv-link-gb-s"):
        make_plan(replace(i, slo=Slo(ttft_s=0.95)))
    plan = make_plan(i)
    with pytest.raises(PlanError, match="no decode batch meets TPOT 5 ms"):
        disagg_plan(
            plan.steps, i.work, plan.memory, Slo(tpot_s=0.005), Target(concurrency=4),
            tp=4, max_num_seqs=256, kv_link_bytes_per_s=25e9, price_per_gpu_hour=None,
        )  # fmt: skip
    # A slow KV link is the whole TTFT: 7,692 x 327,680 bytes over 1 GB/s is 2.5 s.
    slow = make_plan(replace(i, kv_link_bytes_per_s=1e9)).disagg
    assert slow is not None and slow.prefill.transfer_s == pytest.approx(7692 * 327_680 / 1e9)


def test_cli_table_and_json() -> None:
    argv = ["--model", "llama-3-70b", *GUIDE_70B, "--concurrency", "30", "--tpot-ms", "50"]
    out = StringIO()
    assert main([*argv, "--disaggregated", "--gpu-price-per-hour", "2.5"], out=out) == 0
    table = out.getvalue()
    assert "disaggregated (prefill and decode pools)" in table
    assert "P1D" in table and "prefill interference binds" in table
    out = StringIO()
    assert main([*argv, "--disaggregated", "--json"], out=out) == 0
    data = json.loads(out.getvalue())
    assert data["disaggregated"]["decode"]["replicas"] == 1
    assert data["disaggregated"]["ratio"].endswith("P1D")
    assert data["interference"]["batch"] == 13
    # Without the flag the colocated note points at it.
    out = StringIO()
    assert main(argv, out=out) == 0
    assert "--disaggregated sizes prefill and decode pools" in out.getvalue()
    err = StringIO()
    assert main([*argv, "--disaggregated", "--kv-link-gb-s", "0"], out=StringIO(), err=err) == 2
    assert "--kv-link-gb-s must be > 0" in err.getvalue()


# The guide's 7B-on-L40S table: a 7 B model without grouped-query attention (512 KiB of KV
# per token) on one 48 GB L40S, 14 GB of weights and 10 GB of overhead leaving 24 GB for the
# KV cache, at 4K, 8K and 32K of context per request.
GUIDE_7B_L40S = ["--params-b", "7", "--layers", "32", "--heads", "32", "--kv-heads", "32",
                 "--head-dim", "128", "--max-context", "32768", "--gpu", "l40s",
                 "--gpu-memory-utilization", "1.0", "--overhead-gb", "10"]  # fmt: skip


@pytest.mark.parametrize(("context", "floor", "guide"), [(4096, 11, 12), (8192, 5, 6),
                                                          (32768, 1, 1)])  # fmt: skip
def test_the_guides_7b_on_l40s_table(context: int, floor: int, guide: int) -> None:
    i = inputs(*GUIDE_7B_L40S, "--input-tokens", str(context - 256), "--output-tokens", "256")
    mem = memory_plan(i.model, i.work, i.dep)
    assert mem.kv_bytes_per_token == 512 * 1024
    assert mem.kv_pool_bytes == pytest.approx(24e9)
    # A request holds context x 512 KiB: 2, 4 and 16 GiB. 24 GB / 2 GiB = 11.2, so 11 fit;
    # the guide divides 24 by 2, 4 and 16 as if a GiB were a GB and rounds to 12 / 6 / 1.
    assert mem.kv_bytes_per_request == context * 512 * 1024
    assert mem.max_concurrency == floor
    assert math.floor(24 / (context * 512 * 1024 / 1024**3)) == guide
