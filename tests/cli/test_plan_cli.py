"""`kvflow plan` end to end: the installed command in a subprocess, its exit codes and output."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

KVFLOW = Path(sys.executable).parent / "kvflow"  # the console script `pip install` made


def kvflow_plan(*args: str) -> subprocess.CompletedProcess[str]:
    assert KVFLOW.exists(), f"{KVFLOW} is missing: install kvflow (make setup)"
    return subprocess.run(
        [str(KVFLOW), "plan", *args], capture_output=True, text=True, timeout=60, check=False
    )


def test_a_table_for_70b_on_four_h100s() -> None:
    done = kvflow_plan("--model", "llama-3-70b", "--gpu", "h100", "--tp", "4",
                       "--concurrency", "100", "--tpot-ms", "50", "--ttft-ms", "2000",
                       "--gpu-price-per-hour", "2.5")  # fmt: skip
    assert done.returncode == 0, done.stderr
    out = done.stdout
    assert out.startswith("kvflow plan: Llama-3-70B on 4 x H100-SXM\n")
    assert "KV per token               327,680 bytes" in out
    assert "weights                    141.11 GB" in out
    # 4 x 80 x 0.9 - 141.11 - 8 = 138.89 GB; / (1,280 x 327,680 = 419.4 MB) = 331 requests.
    assert "max concurrency            331 requests" in out
    assert "bound by slo" in out
    assert "step times from the roofline: 4 x H100-SXM" in out
    assert "GPUs                       8" in out  # 2 replicas of 4
    assert "cost                       $20.00 per hour" in out  # 8 x $2.50


def test_json_with_a_simulator_profile_and_a_gpu_file(tmp_path: Path) -> None:
    gpu_file = tmp_path / "gpus.yaml"
    gpu_file.write_text("gpus:\n  h100: {price_per_gpu_hour: 3.0}\n")
    done = kvflow_plan("--model", "llama-3-8b", "--gpu", "h100", "--gpu-file", str(gpu_file),
                       "--profile", "h100-llama3-8b", "--mix", "512:128:3,4096:512:1",
                       "--rate", "20", "--redundancy", "1", "--json")  # fmt: skip
    assert done.returncode == 0, done.stderr
    plan = json.loads(done.stdout)
    assert plan["schema"] == "kvflow-plan/1"
    assert plan["memory"]["kv_bytes_per_token"] == 131_072
    assert plan["step_timing"]["is_measured"] is True
    assert plan["step_timing"]["source"].startswith("profile h100-llama3-8b")
    assert any(
        n.startswith("step times from a measured or simulated profile") for n in plan["notes"]
    )
    fleet = plan["fleet"]
    assert fleet["num_replicas"] == fleet["replicas_for_load"] + 1
    assert fleet["num_gpus"] == fleet["num_replicas"]  # tp 1
    assert fleet["cost_per_hour"] == 3.0 * fleet["num_gpus"]
    # 20 req/s x mean output (3 x 128 + 512) / 4 = 224 tokens = 4,480 tokens/s.
    assert abs(fleet["output_tokens_per_s"] - 4480) < 1e-6


def test_bad_input_exits_2_with_a_message() -> None:
    done = kvflow_plan("--model", "llama-3-70b", "--gpu", "b200")
    assert done.returncode == 2 and done.stdout == ""
    assert "unknown GPU 'b200': use one of a100-40gb" in done.stderr
    done = kvflow_plan("--model", "llama-3-70b", "--gpu", "a100-40gb")
    assert done.returncode == 2
    assert "does not fit on 1 x A100-40GB" in done.stderr and "GB missing" in done.stderr
    done = kvflow_plan("--gpu", "h100", "--concurrency", "1", "--rate", "1", "--model", "x")
    assert done.returncode == 2 and "not allowed with argument" in done.stderr  # argparse


def test_kvflow_lists_plan() -> None:
    done = subprocess.run([str(KVFLOW), "--help"], capture_output=True, text=True, check=False)
    assert done.returncode == 0 and "  plan " in done.stdout
