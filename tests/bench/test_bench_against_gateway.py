"""`kvflow bench` end to end: the real CLI against a real gateway and simulated workers.

The workers sleep 20 ms per step, so every token costs at least 20 ms: TPOT and TTFT have
a floor the harness must see, and 16-token answers (about 0.4 s) overlap at 8 req/s, so
an open-loop run has several requests in flight.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.ports import free_port
from testkit.worker_process import launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
STEP_MS = 20.0


@pytest.fixture(scope="module")
def gateway() -> Iterator[GatewayProcess]:
    with ExitStack() as stack:
        workers = []
        for _ in range(2):
            args = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", str(STEP_MS)]
            w = launch_worker(args, timeout_s=120)
            stack.callback(w.stop, timeout_s=10)
            workers.append(w)
        g = launch_gateway(["--served-model-name", MODEL,
                            "--workers", ",".join(w.address for w in workers)])  # fmt: skip
        stack.callback(g.stop)
        g.wait_ready(num_workers=2)
        yield g


def bench(*args: str, timeout_s: float = 120) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "kvflow.cli.main", "bench", *args]
    return subprocess.run(command, capture_output=True, text=True, timeout=timeout_s, check=False)


def test_bench_shared_prefix_against_the_gateway(gateway: GatewayProcess, tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    plot = tmp_path / "bench.png"
    done = bench("--url", gateway.url, "--workload", "shared-prefix", "--groups", "4",
                 "--prefix-words", "200,100", "--question-words", "20", "--output-tokens", "16",
                 "--rates", "8", "--warmup-s", "1", "--duration-s", "4", "--route-header",
                 "--max-lag-ms", "200", "--json", str(out), "--plot", str(plot))  # fmt: skip
    assert done.returncode == 0, done.stderr
    assert "TTFT p50" in done.stdout and "knee: 8 req/s" in done.stdout, done.stdout
    report = json.loads(out.read_text())
    assert report["schema"] == "kvflow-bench/1"
    assert report["config"]["model"] == MODEL  # found with GET /v1/models
    [point] = report["load_points"]
    t, lat, cache = point["throughput"], point["latency"], point["cache"]
    assert t["errors"] == {} and t["num_ok"] == t["num_measured"] >= 20
    assert point["num_warmup"] >= 1
    assert t["mean_output_tokens"] == 16  # ignore_eos honoured: exactly what was asked
    # One word is one token; the chat template adds a few dozen around the two messages.
    words = (200 + 100) / 2 + 20
    assert words < t["mean_prompt_tokens"] < words + 80
    # Every token costs a 20 ms step at least; batching keeps it near that.
    assert 0.9 * STEP_MS / 1e3 <= lat["tpot_s"]["p50"] < 5 * STEP_MS / 1e3
    assert lat["ttft_s"]["p50"] >= 0.9 * STEP_MS / 1e3
    assert lat["itl_s"]["count"] > 0 and lat["e2e_s"]["p50"] > 15 * STEP_MS / 1e3
    assert point["schedule"]["is_valid"], point["schedule"]["problems"]
    assert point["schedule"]["offered_rate_per_s"] == 8
    assert point["schedule"]["lag_s"]["count"] == t["num_measured"]
    # Four groups share two prefixes over two workers: the cache serves most of each prompt
    # after the first of each group, and the router spreads the groups.
    assert cache["hit_rate"] > 0.3 and cache["router_hit_rate"] > 0.3
    assert len(cache["requests_per_worker"]) == 2
    # The gateway's header says where each went by its prefix (mostly to its holder).
    assert sum(cache["prefix_outcomes"].values()) == t["num_ok"]
    assert cache["prefix_outcomes"]["best_holder"] > t["num_ok"] / 2
    assert report["knee"] == {"label": "8 req/s", "qps": 8}
    assert plot.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def test_bench_replays_a_trace_and_runs_closed_loop(
    gateway: GatewayProcess, tmp_path: Path
) -> None:
    # 30 requests 100 ms apart sharing their first two 512-token blocks; at 2x, 20 req/s.
    trace = tmp_path / "trace.jsonl"
    lines = [{"timestamp": 100 * i, "input_length": 1500, "output_length": 40,
              "hash_ids": [0, 1, 100 + i]} for i in range(30)]  # fmt: skip
    trace.write_text("".join(json.dumps(x) + "\n" for x in lines))
    out = tmp_path / "trace.json"
    done = bench("--url", gateway.url, "--workload", "trace", "--trace", str(trace),
                 "--speedups", "2", "--input-scale", "0.1", "--output-scale", "0.2",
                 "--warmup-s", "0.5", "--max-lag-ms", "200", "--quiet",
                 "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    [point] = json.loads(out.read_text())["load_points"]
    assert point["label"] == "trace x2" and point["num_warmup"] == 10  # offsets 0..0.45 s
    assert point["throughput"]["num_ok"] == 20 and point["throughput"]["errors"] == {}
    assert point["schedule"]["offered_rate_per_s"] == pytest.approx(20.0)
    assert point["throughput"]["mean_output_tokens"] == 8  # 40 x 0.2
    assert point["cache"]["hit_rate"] > 0.3  # 102 of each 150 words are the shared blocks

    out = tmp_path / "closed.json"
    done = bench("--url", gateway.url, "--api", "completions", "--workload", "multi-turn",
                 "--users", "3", "--warmup-s", "0.5", "--duration-s", "2", "--output-tokens",
                 "4", "--quiet", "--json", str(out))  # fmt: skip
    assert done.returncode == 0, done.stderr
    [point] = json.loads(out.read_text())["load_points"]
    assert point["label"] == "3 users" and point["schedule"]["offered_rate_per_s"] is None
    assert point["throughput"]["num_ok"] > 3 and point["throughput"]["errors"] == {}
    assert point["cache"]["hit_rate"] > 0  # later turns resend earlier ones


def test_bench_reports_an_endpoint_that_does_not_answer() -> None:
    url = f"http://127.0.0.1:{free_port()}"
    done = bench("--url", url, "--model", "m", "--workload", "no-reuse", "--rates", "20",
                 "--warmup-s", "0", "--duration-s", "0.5", "--quiet")  # fmt: skip
    assert done.returncode == 1
    assert "connect_error" in done.stdout and "no request succeeded" in done.stderr


def test_bench_rejects_a_malformed_trace(tmp_path: Path) -> None:
    trace = tmp_path / "bad.jsonl"
    good = {"timestamp": 0, "input_length": 10, "output_length": 1, "hash_ids": [0]}
    bad = {**good, "timestamp": 5, "input_length": -1}
    trace.write_text(f"{json.dumps(good)}\n{json.dumps(bad)}\n")
    done = bench("--url", "http://127.0.0.1:9", "--model", "m", "--workload", "trace",
                 "--trace", str(trace))  # fmt: skip
    assert done.returncode == 2
    assert f"{trace} line 2: field 'input_length' must be an integer >= 1, got -1" in done.stderr
