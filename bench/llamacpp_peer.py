"""llama.cpp's server against kvflow on the same GGUF, under the same `kvflow bench` load.

The peer people who serve small models on CPUs pick: llama-cpp-python's OpenAI server
(`python -m llama_cpp.server`, `make llamacpp` installs it into `.venv-llamacpp`) on the
built-in SmolLM2-135M-Instruct Q4_1 GGUF, against kvflow (one `kvflow router` over one
`kvflow worker`, the shape `kvflow up` starts) on the same file. Both get the same number
of CPU threads (`--threads`, default 1: on a shared 2-core machine two OpenMP threads
spin against other jobs, and llama.cpp's 32-token answer took 1.1-5.3 s with 2 threads
against 0.5-0.8 s with 1 when this was written).

What differs, by design of each server:
- llama.cpp multiplies with its quantized Q4_1 kernels (weights stay 4-bit, activations go
  to 8 bits); kvflow keeps the Q4_1 weights as 4-bit planes and multiplies with torch's
  int4 kernel in bf16 (small batches) or widens them for a bf16 GEMM (large ones). The
  ``kvflow-widened`` arm is kvflow with ``--quantization none``: the GGUF widened to
  float32 at load, torch's float32 GEMMs (how kvflow ran GGUFs before).
- llama-cpp-python's server runs one request at a time (an asyncio lock around the model;
  it has no parallel-slots option, unlike llama.cpp's own C++ `llama-server -np N`), so
  concurrent requests queue; it is started with `--interrupt_requests False`, else each new
  request cuts the running one short, and `--logits_all False` (the server's default, True,
  keeps every prompt position's logits for logprobs nobody asks for here; measured: no
  difference beyond noise). kvflow batches all running requests continuously.

Workload (the same request bytes to both, `bench/llamacpp_client.py`): `--workload
no-reuse`, completions API, short prompts, a fixed number of output tokens (``min_tokens =
max_tokens``, greedy), closed loop at `--users 1,8,32`. The arms interleave, llama.cpp then
kvflow, `--repeats` times; each repeat draws new text (seed = repeat), the same for both.
Throughput is the served rate by Little's law (`bench/llamacpp_report.py` says why).

    flock /tmp/kvflow-bench.lock python bench/llamacpp_peer.py --json out/bench/llamacpp.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator, Sequence
from contextlib import ExitStack, contextmanager
from pathlib import Path
from typing import Any

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from llamacpp_report import SERVERS, as_json, render, rows  # noqa: E402
from testkit.gateway_process import launch_gateway  # noqa: E402
from testkit.ports import free_port  # noqa: E402
from testkit.worker_process import launch_worker  # noqa: E402

from kvflow.engine_worker.model.quant.int4_weight import (  # noqa: E402
    gemv_activations,
    use_native_gemv,
)

MODEL_NAME = "smollm2"
ARMS = SERVERS  # every server the report orders


def _thread_env(threads: int) -> dict[str, str]:
    return {"OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}


def _wait_models(url: str, proc: subprocess.Popen[bytes], log: Path, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"llama.cpp server exited {proc.returncode}:\n{log.read_text()}")
        try:
            if httpx.get(f"{url}/v1/models", timeout=2).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.3)
    raise TimeoutError(f"llama.cpp server not ready after {timeout_s} s:\n{log.read_text()}")


def has_amx() -> bool:
    """llama.cpp's extra buffer types crash on AMX CPUs (``llamacpp_server.py``)."""
    try:
        return "amx_int8" in Path("/proc/cpuinfo").read_text()
    except OSError:
        return False


@contextmanager
def llamacpp_server(python: str, model: str, threads: int, tmp: Path) -> Iterator[str]:
    port = free_port()
    log = tmp / "llamacpp.log"
    cmd = [
        python,
        str(ROOT / "bench" / "llamacpp_server.py"),
        *(["--no-extra-bufts"] if has_amx() else []),
        "--model",
        model,
        "--model_alias",
        MODEL_NAME,
        "--host",
        "127.0.0.1",
        "--port",
        str(port),
        "--n_ctx",
        "2048",
        "--n_threads",
        str(threads),
        "--n_threads_batch",
        str(threads),
        "--interrupt_requests",
        "False",
        "--disable_ping_events",
        "True",
        "--logits_all",
        "False",
        "--verbose",
        "False",
    ]
    with log.open("wb") as out:
        proc = subprocess.Popen(
            cmd, stdout=out, stderr=subprocess.STDOUT, env={**os.environ, **_thread_env(threads)}
        )
    url = f"http://127.0.0.1:{port}"
    try:
        _wait_models(url, proc, log, timeout_s=120)
        yield url
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


@contextmanager
def kvflow_server(
    model: str, threads: int, kv_cache_gib: float, quantization: str = "auto"
) -> Iterator[str]:
    with ExitStack() as stack:
        worker = launch_worker(
            [
                "--model",
                model,
                "--served-model-name",
                MODEL_NAME,
                "--kv-cache-gib",
                str(kv_cache_gib),
                "--quantization",
                quantization,
            ],
            timeout_s=300,
            env=_thread_env(threads),
        )
        stack.callback(worker.stop, timeout_s=10)
        gateway = launch_gateway(["--model", model, "--workers", worker.address])
        stack.callback(gateway.stop)
        gateway.wait_ready(num_workers=1, timeout_s=120)
        yield gateway.url


def bench_args(args: argparse.Namespace, url: str, seed: int, json_path: Path) -> list[str]:
    return [
        sys.executable,
        str(ROOT / "bench" / "llamacpp_client.py"),
        "--url",
        url,
        "--model",
        MODEL_NAME,
        "--api",
        "completions",
        "--no-ignore-eos",
        "--workload",
        "no-reuse",
        "--prompt-words",
        str(args.prompt_words),
        "--output-tokens",
        str(args.output_tokens),
        "--users",
        args.users,
        "--duration-s",
        str(args.duration_s),
        "--warmup-s",
        str(args.warmup_s),
        "--request-timeout-s",
        "300",
        "--seed",
        str(seed),
        "--quiet",
        "--json",
        str(json_path),
    ]


def run_arm(args: argparse.Namespace, server: str, url: str, seed: int, tmp: Path) -> Any:
    path = tmp / f"{server}-{seed}.json"
    started = time.monotonic()
    done = subprocess.run(
        bench_args(args, url, seed, path), check=False, capture_output=True, text=True
    )
    wall_s = time.monotonic() - started
    if done.returncode != 0:
        raise RuntimeError(
            f"kvflow bench on {server} exited {done.returncode}:\n{done.stdout}\n{done.stderr}"
        )
    print(
        f"  {server} run {seed}: {wall_s:.0f} s, load average {os.getloadavg()[0]:.1f}",
        file=sys.stderr,
    )
    return json.loads(path.read_text())


def _git(args: list[str]) -> str:
    done = subprocess.run(["git", *args], cwd=ROOT, check=False, capture_output=True, text=True)
    return done.stdout.strip()


def parse(argv: Sequence[str]) -> argparse.Namespace:
    from kvflow.engine_worker.model.default_model import default_model_path

    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--llamacpp-python", default=str(ROOT / ".venv-llamacpp/bin/python"))
    p.add_argument("--model", default=None, help="GGUF (default: the built-in SmolLM2 Q4_1)")
    p.add_argument("--threads", type=int, default=1, help="CPU threads of each server")
    p.add_argument("--users", default="1,8,32", help="closed-loop concurrency ladder")
    p.add_argument("--prompt-words", type=int, default=64)
    p.add_argument("--output-tokens", type=int, default=32)
    p.add_argument("--duration-s", type=float, default=12.0, help="measured, per load point")
    p.add_argument("--warmup-s", type=float, default=3.0)
    p.add_argument("--repeats", type=int, default=2, help="interleaved runs per server")
    p.add_argument("--kv-cache-gib", type=float, default=0.5)
    p.add_argument(
        "--arms",
        default=",".join(ARMS),
        help=f"servers to run, interleaved in this order: any of {','.join(ARMS)}",
    )
    p.add_argument("--json", type=Path, default=None)
    args = p.parse_args(argv)
    args.arms = [a for a in args.arms.split(",") if a]
    if unknown := set(args.arms) - set(ARMS):
        p.error(f"unknown arms {sorted(unknown)}: choose from {','.join(ARMS)}")
    args.model = args.model or str(default_model_path())
    if not Path(args.llamacpp_python).exists():
        p.error(f"{args.llamacpp_python} not found: `make llamacpp` installs it")
    return args


def main(argv: Sequence[str]) -> int:
    args = parse(argv)
    started = time.monotonic()
    load_before = os.getloadavg()
    runs: list[tuple[str, Any]] = []
    with tempfile.TemporaryDirectory(prefix="llamacpp-peer-") as tmp_name, ExitStack() as stack:
        tmp = Path(tmp_name)
        urls = {}
        for arm in args.arms:
            if arm == "llama.cpp":
                server = llamacpp_server(args.llamacpp_python, args.model, args.threads, tmp)
            else:
                quantization = "none" if arm == "kvflow-widened" else "auto"
                server = kvflow_server(args.model, args.threads, args.kv_cache_gib, quantization)
            urls[arm] = stack.enter_context(server)
        print(f"servers up in {time.monotonic() - started:.0f} s", file=sys.stderr)
        for seed in range(args.repeats):
            for server in args.arms:
                runs.append((server, run_arm(args, server, urls[server], seed, tmp)))
    table = rows(runs)
    wall_s = time.monotonic() - started
    print(
        f"model {Path(args.model).name}, {args.threads} CPU thread(s) per server; "
        f"no-reuse, completions, {args.prompt_words}-word prompts, {args.output_tokens} "
        f"output tokens (greedy, min_tokens = max_tokens), closed loop; median of "
        f"{args.repeats} interleaved runs, {args.duration_s:.0f} s measured per point; "
        f"{wall_s:.0f} s in all; load average {load_before[0]:.1f} -> "
        f"{os.getloadavg()[0]:.1f}\n"
    )
    print(render(table))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {
            "schema": "kvflow-llamacpp-peer/1",
            "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
            "config": {k: str(v) if isinstance(v, Path) else v for k, v in vars(args).items()},
            # Other work may sit uncommitted in this checkout: say which engine it measured.
            "git_head": _git(["rev-parse", "HEAD"]),
            "git_dirty": _git(["status", "--porcelain", "--", "engine_worker", "router"]),
            "load_average_before": load_before,
            "llamacpp_extra_bufts": not has_amx(),
            # What kvflow's 4-bit products ran on (its workers read the same environment).
            "kvflow_int4_gemv": use_native_gemv(),
            "kvflow_gemv_activations": gemv_activations(),
            "load_average_after": os.getloadavg(),
            "wall_s": wall_s,
            **as_json(table),
            "runs": [{"server": s, "report": r} for s, r in runs],
        }
        args.json.write_text(json.dumps(record, indent=1) + "\n")
        print(f"wrote {args.json}", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
