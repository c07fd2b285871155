"""What splitting a model over tensor-parallel ranks costs, on the CPU, worker against worker.

Two real `kvflow worker` processes over the 56 M Llama of bench/engine_throughput.py (8
heads, 8 KV heads, MLP 1,376, vocabulary 32 k): one rank, and 2 ranks (`--tensor-parallel-
size 2`: each rank a process with half the heads, half the MLP and half the vocabulary,
gloo between them). Both use the same cores (a rank takes its share of them), so the ratio
is the price of the split itself (two collectives a layer, a plan per step, two Python
processes), not a scaling: on GPUs each rank adds a device, which this machine cannot show.

Arms interleave, `--rounds` times: one request decoding 128 tokens (the inter-token time at
batch 1), and 16 concurrent requests of 64 tokens each (output tokens per second).

    python bench/tp_cpu.py [--rounds 3] [--json PATH]
"""

from __future__ import annotations

import argparse
import itertools
import json
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import grpc

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))
sys.path.insert(0, str(ROOT / "bench"))

from engine_throughput import tiny_model  # noqa: E402
from testkit.worker_process import WorkerProcess, launch_worker  # noqa: E402

from kvflow.proto import worker_pb2 as pb  # noqa: E402
from kvflow.proto import worker_pb2_grpc as pb_grpc  # noqa: E402

ARMS = {"tp1": 1, "tp2": 2}


def generate(address: str, rid: str, prompt: list[int], max_tokens: int) -> list[float]:
    """Arrival times of the request's tokens."""
    with grpc.insecure_channel(address) as channel:
        request = pb.GenerateRequest(
            request_id=rid,
            prompt_token_ids=prompt,
            sampling=pb.SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True),
        )
        times = []
        for reply in pb_grpc.WorkerStub(channel).Generate(request, timeout=600):
            times.extend([time.perf_counter()] * len(reply.token_ids))
        return times


def batch1_itl_ms(worker: WorkerProcess, round_: int) -> float:
    prompt = [(i * 7 + round_) % 31000 + 5 for i in range(64)]
    times = generate(worker.address, f"b1-{round_}", prompt, 128)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    return 1000 * statistics.median(gaps)


def batch16_tok_s(worker: WorkerProcess, round_: int) -> float:
    prompts = [[(i * 13 + j * 101 + round_) % 31000 + 5 for i in range(64)] for j in range(16)]
    started = time.perf_counter()
    with ThreadPoolExecutor(16) as pool:
        futures = [
            pool.submit(generate, worker.address, f"b16-{round_}-{j}", p, 64)
            for j, p in enumerate(prompts)
        ]
        produced = sum(len(f.result()) for f in futures)
    return produced / (time.perf_counter() - started)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        model = tiny_model(Path(tmp))
        common = ["--model", model, "--num-kv-blocks", "2048"]
        workers = {
            arm: launch_worker([*common, "--tensor-parallel-size", str(size)], timeout_s=300)
            for arm, size in ARMS.items()
        }
        results: dict[str, dict[str, list[float]]] = {a: {"itl_ms": [], "tok_s": []} for a in ARMS}
        try:
            for worker in workers.values():  # warm-up
                batch1_itl_ms(worker, -1)
            for round_ in range(args.rounds):
                for arm, worker in workers.items():
                    results[arm]["itl_ms"].append(batch1_itl_ms(worker, round_))
                    results[arm]["tok_s"].append(batch16_tok_s(worker, round_))
                    print(
                        f"round {round_ + 1} {arm}: batch 1 ITL "
                        f"{results[arm]['itl_ms'][-1]:.1f} ms, 16 users "
                        f"{results[arm]['tok_s'][-1]:.1f} tok/s",
                        flush=True,
                    )
        finally:
            for worker in workers.values():
                worker.stop(timeout_s=20)
    summary: dict[str, Any] = {
        arm: {k: statistics.median(v) for k, v in r.items()} for arm, r in results.items()
    }
    itl = summary["tp2"]["itl_ms"] / summary["tp1"]["itl_ms"]
    tok = summary["tp2"]["tok_s"] / summary["tp1"]["tok_s"]
    print(f"\n2 ranks / 1 rank on the same cores: batch-1 ITL {itl:.2f}x, 16-user tok/s {tok:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        record = {"rounds": args.rounds, "runs": results, "medians": summary,
                  "itl_ratio_tp2_over_tp1": itl, "tok_s_ratio_tp2_over_tp1": tok}  # fmt: skip
        args.json.write_text(json.dumps(record, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
