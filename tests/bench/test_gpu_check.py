"""bench/gpu_check.sh end to end, so the GPU script cannot rot between GPU sessions.

On any machine: the CPU mode (``--dry-run``: the tiny plan) through every stage, each in
its own process, with transformers as the reference and real peer processes for the KV
transfer, and ``gguf`` absent as on the device image (tests/testkit/device_image.py);
then a run where one stage raises and one hangs past its budget, to show both
are recorded and the run goes on. Speed is not asserted (a benchmark is not a test); that
the numbers exist, agree with each other and say what they claim is.

Where a CUDA GPU exists, the ``gpu`` test runs the CUDA path at SmolLM2's shape
(``--size small``, about two minutes); elsewhere it is skipped and reported as not run.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.device_image import env_without

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]
STAGES = [
    "env",
    "gpu_tests",
    "parity",
    "roofline",
    "prefill",
    "throughput",
    "quant",
    "profile",
    "kv_transfer",
]


def run_check(
    out: Path, *args: str, env: dict[str, str] | None = None, timeout_s: float = 700
) -> tuple[subprocess.CompletedProcess[str], dict[str, Any]]:
    proc = subprocess.run(
        ["bash", "bench/gpu_check.sh", "--json", str(out), *args],
        cwd=ROOT,
        env={**env_without(out.parent, "gguf"), **(env or {})},
        capture_output=True,
        text=True,
        timeout=timeout_s,
        check=False,
    )
    report = json.loads(out.read_text()) if out.exists() else {}
    return proc, report


@pytest.fixture(scope="module")
def cpu(tmp_path_factory: pytest.TempPathFactory) -> dict[str, Any]:
    proc, report = run_check(tmp_path_factory.mktemp("gpu") / "check.json", "--dry-run", "--strict")
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    assert "### Parity with transformers" in proc.stdout
    assert "### Targets (issue 34)" in proc.stdout
    return report


def result(report: dict[str, Any], stage: str) -> dict[str, Any]:
    r: dict[str, Any] = report["stages"][stage]["result"]
    return r


def test_every_stage_runs_in_the_cpu_mode(cpu: dict[str, Any]) -> None:
    assert cpu["meta"]["device"] == "cpu" and cpu["meta"]["size"] == "tiny"
    assert cpu["meta"]["stages_in_process"] is True
    assert {n: s["status"] for n, s in cpu["stages"].items()} == dict.fromkeys(STAGES, "ok")
    assert cpu["meta"]["setup_s"] is not None and cpu["meta"]["setup_s"] >= 0
    assert cpu["summary"]["stages_not_ok"] == {}
    # Targets are judged on the full plan on a GPU only, and say so.
    assert cpu["summary"]["batch1_decode"]["met"] is None
    assert cpu["summary"]["throughput_batch64"]["met"] is None
    assert cpu["summary"]["prefill_8k"]["met"] is None
    assert cpu["summary"]["cuda_graphs"]["default_on_recommended"] is None


def test_the_gpu_tests_run_inside_the_check(cpu: dict[str, Any]) -> None:
    r = result(cpu, "gpu_tests")
    assert r["files"] and all(f.startswith("tests/") for f in r["files"])
    # No CUDA here: every test marked gpu was collected (no file failed to import without
    # gguf) and skipped with its reason.
    assert r["exit_code"] == 0 and r["summary"]["failures"] == []
    assert r["summary"]["counts"].get("skipped", 0) >= len(r["files"])
    assert set(r["summary"]["counts"]) == {"skipped"}
    assert cpu["summary"]["gpu_tests"] == r["summary"]["counts"]


def test_parity_with_transformers(cpu: dict[str, Any]) -> None:
    cases = result(cpu, "parity")["cases"]
    assert set(cases) == {"tiny/float32", "tiny/bfloat16"}
    f32 = cases["tiny/float32"]
    assert f32["all_identical"] and f32["max_margin"] == 0.0
    assert f32["prefill"]["max_abs_diff"] < 1e-4 * f32["prefill"]["ref_logit_std"]
    assert f32["prefill"]["argmax_agreement"] == 1.0
    for row in f32["greedy"]:
        assert row["agree_leading"] == row["new_tokens"] == 8
        assert row["max_top_logprob_diff"] < 1e-4
    # The same prompts with --cuda-graphs' padded decode steps (run eagerly on a CPU).
    assert f32["graphs"]["identical_to_eager"] and f32["graphs"]["ok"]
    assert f32["graphs"]["steps"] > 0 and f32["graphs"]["captures"] == 0
    bf16 = cases["tiny/bfloat16"]
    assert bf16["passed"] and bf16["max_margin"] <= bf16["margin_tol"]
    assert bf16["graphs"]["ok"] and bf16["graphs"]["steps"] > 0
    # Our bf16 logits are no further from float32 arithmetic than transformers' bf16 are.
    pre = bf16["prefill"]
    assert 0 < pre["ours_vs_f32_mean_abs"] <= 2 * pre["transformers_vs_f32_mean_abs"]
    assert bf16["prefill"]["argmax_agreement"] > 0.9


def test_roofline_arithmetic(cpu: dict[str, Any]) -> None:
    r = result(cpu, "roofline")
    ceiling = r["roofline_datasheet"]
    # The tiny shape in float32: every weight but the embedding table, read once per step.
    vocab, hidden, ffn, layers, heads, kv_heads, head_dim = 1024, 64, 128, 2, 4, 2, 16
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * ffn + 2 * hidden
    weights = 4 * (vocab * hidden + layers * per_layer + hidden)
    assert ceiling["weight_bytes_per_step"] == weights
    kv_per_token = 2 * layers * kv_heads * head_dim * 4
    assert ceiling["mean_context"] == 32 + 16 / 2
    assert ceiling["kv_bytes_per_step"] == kv_per_token * ceiling["mean_context"]
    assert ceiling["tokens_per_s"] == pytest.approx(4.8e12 / (weights + kv_per_token * 40))
    assert r["engine_graphs"]["graph_steps"] == 16 - 1 + 1  # the measured decodes, the warm-up's
    assert r["engine_graphs"]["captures"] == 0  # nothing to capture on a CPU
    # --cuda-graphs on and off: the same greedy tokens (the padded step run eagerly here).
    assert (
        r["engine"]["tokens"] == r["engine_graphs"]["tokens"] and len(r["engine"]["tokens"]) == 16
    )
    assert r["cuda_graphs"]["tokens_identical"] is True
    assert r["cuda_graphs"]["speedup"] == pytest.approx(
        r["engine_graphs"]["decode_tokens_per_s"] / r["engine"]["decode_tokens_per_s"]
    )
    # The 70B slice's stand-in (GQA 8:1): its own roofline, both arms, the same tokens.
    gqa = r["shapes"]["tiny-gqa8"]
    per_layer = 128 * 16 * (2 * 8 + 2 * 1) + 3 * 128 * 256 + 2 * 128
    assert gqa["roofline_datasheet"]["weight_bytes_per_step"] == 4 * (
        1024 * 128 + 2 * per_layer + 128
    )
    assert gqa["engine"]["tokens"] == gqa["engine_graphs"]["tokens"]
    assert gqa["engine"]["fraction_of_roofline"] == pytest.approx(
        gqa["engine"]["decode_tokens_per_s"] / gqa["roofline_datasheet"]["tokens_per_s"]
    )
    for key in ("engine", "engine_graphs", "forward", "transformers"):
        tps = r[key].get("decode_tokens_per_s") or r[key]["tokens_per_s"]
        assert tps > 0
        assert r[key]["fraction_of_roofline"] == pytest.approx(tps / ceiling["tokens_per_s"])


def test_throughput_arms_produce_every_token(cpu: dict[str, Any]) -> None:
    rows = result(cpu, "throughput")["rows"]
    assert set(rows) == {"2", "4"}
    for batch, row in rows.items():
        assert row["requests"] == int(batch)
        for arm in ("kvflow", "kvflow-graphs", "transformers"):
            assert row[arm]["output_tokens"] == row["output_tokens"], (batch, arm)
            assert row[arm]["tokens_per_s"] == pytest.approx(
                row[arm]["output_tokens"] / row[arm]["wall_s"]
            )
        assert row["ratio"] == pytest.approx(
            row["kvflow"]["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        )
        graphed = row["kvflow-graphs"]
        assert graphed["captures"] == 0 and graphed["capture_s"] == 0  # a CPU captures nothing
        assert graphed["tokens_per_s_captured"] == pytest.approx(graphed["tokens_per_s"])
        assert row["ratio_graphs"] == pytest.approx(
            graphed["tokens_per_s"] / row["transformers"]["tokens_per_s"]
        )


def test_prefill_flops_and_mfu(cpu: dict[str, Any]) -> None:
    r = result(cpu, "prefill")
    assert r["prompt_len"] == 256 and set(r["shapes"]) == {"tiny", "tiny-gqa8"}
    n = 256
    tiny = r["shapes"]["tiny"]
    # Matrices for every token (the LM head for the last only) and causal attention.
    vocab, hidden, ffn, layers, heads, kv_heads, head_dim = 1024, 64, 128, 2, 4, 2, 16
    per_layer = hidden * head_dim * (2 * heads + 2 * kv_heads) + 3 * hidden * ffn + 2 * hidden
    matmul = 2 * (layers * per_layer + hidden) * n + 2 * vocab * hidden
    assert tiny["flops"]["matmul"] == matmul
    assert tiny["flops"]["attention"] == 4 * layers * heads * head_dim * n * (n + 1) / 2
    assert tiny["steps"] == 2  # 256 tokens in chunks of 128
    assert tiny["mfu_datasheet"] == pytest.approx(tiny["flops"]["total"] / tiny["ttft_s"] / 989e12)
    assert set(cpu["summary"]["prefill_8k"]["fraction_of_measured_matmul"]) == {"tiny", "tiny-gqa8"}


def test_fp8_arms_run_and_stay_close_to_the_baseline(cpu: dict[str, Any]) -> None:
    arms = result(cpu, "quant")["arms"]
    assert list(arms) == ["baseline", "fp8_weights", "fp8_kv", "fp8_both"]
    base = arms["baseline"]
    assert base["logit_error_of_spread"] == 0 and base["greedy_agree_leading_vs_baseline"] == 8
    for name, arm in arms.items():
        assert arm["batch_output_tokens"] == 4 * 6, name
        assert arm["decode_tokens_per_s"] > 0
        assert arm["fraction_of_roofline"] == pytest.approx(
            arm["decode_tokens_per_s"] / arm["roofline_tokens_per_s"]
        )
    # The tiny shape's KV per token as stored: K and V x 2 layers x 2 heads x 16 dims, in
    # float32, or one byte each plus a float16 scale per head row.
    assert base["kv_bytes_per_token"] == 2 * 2 * 2 * 16 * 4
    assert arms["fp8_kv"]["kv_bytes_per_token"] == 2 * 2 * 2 * (16 + 2)
    # FP8 weights read fewer bytes per step than float32 ones; an FP8 cache fewer KV bytes.
    assert arms["fp8_weights"]["step_bytes"] < base["step_bytes"]
    assert arms["fp8_kv"]["step_bytes"] < base["step_bytes"]
    # e4m3 keeps 3 bits of mantissa: the logits move, but by a fraction of their spread.
    for name in ("fp8_weights", "fp8_kv", "fp8_both"):
        assert 0 < arms[name]["logit_error_of_spread"] < 0.3, (name, arms[name])


def test_the_profile_is_written_as_a_profile_file(cpu: dict[str, Any]) -> None:
    from kvflow.engine_worker.sim.profile_file import read_profile

    r = result(cpu, "profile")
    assert r["fit"]["num_samples"] > 10
    path = Path(cpu["meta"]["profile_file"])
    profile = read_profile(path)  # the schema kvflow sim and kvflow plan read
    assert profile.name == r["profile"]["name"] == "measured-tiny-cpu"
    assert profile.max_num_seqs == 8 and profile.num_kv_blocks == 256
    assert (
        profile.kv_bytes_per_block == 2 * 2 * 16 * 2 * 16 * 4
    )  # K, V x layers x block x heads x dims x f32
    assert cpu["summary"]["profile"] == profile.name


def test_kv_transfer_moves_the_right_bytes(cpu: dict[str, Any]) -> None:
    r = result(cpu, "kv_transfer")
    block_bytes = 2 * 4 * 2 * 32 * 16 * 4  # K and V x layers x heads x dims x block x f32
    assert [row["tokens"] for row in r["block_io"]] == [64, 256]
    for row in r["block_io"]:
        assert row["verified"] is True
        assert row["num_bytes"] == row["tokens"] // 16 * block_bytes
    pair = r["pair"]
    assert "no GPU" in pair["nccl"]["skipped"]
    for transport in ("tcp", "gloo"):
        rows = pair[transport]["rows"]
        assert [(x["tokens"], x["rep"]) for x in rows] == [(64, 0), (64, 1), (256, 0), (256, 1)]
        assert all(x["verified"] is True and x["gbps"] > 0 for x in rows), rows
    assert cpu["summary"]["kv_pair"] == {"nccl": pair["nccl"]["skipped"], "tcp": True, "gloo": True}


def test_a_failed_and_an_overdue_stage_are_recorded_and_the_run_goes_on(tmp_path: Path) -> None:
    proc, report = run_check(
        tmp_path / "check.json",
        "--dry-run",
        "--isolate",
        "yes",  # each stage in its own process, killed at its budget, as on the device
        "--strict",
        "--stages",
        "parity,roofline,env",
        "--stage-budget",
        "roofline=4",
        env={"KVFLOW_GPU_CHECK_FAIL": "parity=raise,roofline=hang"},
        timeout_s=120,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]  # --strict
    stages = report["stages"]
    assert list(stages) == ["parity", "roofline", "env"]
    assert stages["parity"]["status"] == "error"
    assert "injected failure" in stages["parity"]["result"]["error"]
    assert stages["roofline"]["status"] == "timeout"
    assert stages["roofline"]["wall_s"] < 4 + 10  # killed at its budget, not after an hour
    assert stages["env"]["status"] == "ok"  # the run went on
    assert report["summary"]["stages_not_ok"] == {"parity": "error", "roofline": "timeout"}
    assert "| roofline | timeout |" in proc.stdout


def _has_cuda() -> bool:
    return torch.cuda.is_available()


@pytest.mark.gpu
@pytest.mark.skipif(not _has_cuda(), reason="needs a CUDA GPU; not run here")
def test_cuda_path_at_smollm2_shape(tmp_path: Path) -> None:
    proc, report = run_check(
        tmp_path / "check.json", "--device", "cuda", "--size", "small", timeout_s=500
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-4000:]
    stages = report["stages"]
    assert {n: s["status"] for n, s in stages.items()} == dict.fromkeys(STAGES, "ok"), stages
    cases = stages["parity"]["result"]["cases"]
    assert all(c["passed"] for c in cases.values()), cases
    assert cases["smollm2/float32"]["all_identical"]
    rows = stages["throughput"]["result"]["rows"]
    for row in rows.values():
        for arm in ("kvflow", "kvflow-graphs", "transformers"):
            assert row[arm]["output_tokens"] == row["output_tokens"]
    kv = stages["kv_transfer"]["result"]
    assert all(r["verified"] for r in kv["block_io"])
    for transport in ("tcp", "gloo"):
        assert all(r["verified"] for r in kv["pair"][transport]["rows"])
    # NCCL between two ranks on one GPU: either it moved verified bytes, or the reason it
    # could not is recorded.
    nccl = kv["pair"]["nccl"]
    assert nccl.get("error") or all(r.get("verified") or r.get("error") for r in nccl["rows"])
