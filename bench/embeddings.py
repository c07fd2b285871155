"""Embeddings per second for a batch of 64 short texts (docs/benchmarks.md, "Embeddings").

Three arms, one run: the model alone in this process (tokenize + forward, embed/model.py),
one `Embed` call to a real `kvflow worker --task embed` over gRPC, and the whole path: the
official openai client through a real `kvflow router` to that worker. Each arm embeds the
same 64 texts (5-12 words each) `--repeats` times after a warm-up and reports the median
batch time and embeddings per second.

    python bench/embeddings.py --json docs/bench-data/embeddings.json
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import os
import platform
import statistics
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import grpc
import openai
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT.parent / "tests"))

from testkit.gateway_process import running_gateway  # noqa: E402
from testkit.worker_process import running_worker  # noqa: E402

from kvflow.engine_worker.embed.model import StaticEmbedder  # noqa: E402
from kvflow.engine_worker.embed.model_files import embedding_model_files  # noqa: E402
from kvflow.proto import worker_pb2 as pb  # noqa: E402
from kvflow.proto import worker_pb2_grpc as pb_grpc  # noqa: E402

MODEL = "wordllama-l2-supercat"
_SENTENCE = (
    "the quick brown fox jumps over a lazy dog while embeddings map short texts to "
    "vectors that sit near each other when their meanings agree"
)
WORDS = _SENTENCE.split(" ")


def texts(n: int = 64) -> list[str]:
    """64 short texts of 5 to 12 words, fixed."""
    return [" ".join(WORDS[(i * 7 + j) % len(WORDS)] for j in range(5 + i % 8)) for i in range(n)]


def timed(fn: Callable[[], object], repeats: int) -> dict[str, float]:
    for _ in range(3):
        fn()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    median = statistics.median(times)
    return {"median_batch_ms": median * 1e3, "p90_batch_ms": sorted(times)[int(0.9 * len(times))]
            * 1e3, "embeddings_per_s": 64 / median}  # fmt: skip


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=50)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batch = texts()
    model = StaticEmbedder.load(embedding_model_files(None))
    arms: dict[str, Any] = {}
    threads = torch.get_num_threads()
    for n in sorted({threads, 1}, reverse=True):  # the worker runs one (embed/app.py)
        torch.set_num_threads(n)
        arms[f"model_{n}_threads"] = timed(
            lambda: model.embed(model.tokenize(batch), 256), args.repeats
        )
    torch.set_num_threads(threads)
    with running_worker(["--task", "embed"]) as worker:
        request = pb.EmbedRequest(inputs=[pb.EmbedInput(text=t) for t in batch])
        with grpc.insecure_channel(worker.address) as channel:
            stub = pb_grpc.WorkerStub(channel)
            arms["worker_grpc"] = timed(lambda: stub.Embed(request, timeout=30), args.repeats)
        with running_gateway(["--workers", worker.address]) as gateway:
            gateway.wait_ready()
            client = openai.OpenAI(base_url=gateway.base_url, api_key="none", max_retries=0)
            tokens = client.embeddings.create(model=MODEL, input=batch).usage.prompt_tokens
            for fmt in ("float", "base64"):
                arms[f"gateway_{fmt}"] = timed(
                    lambda fmt=fmt: client.embeddings.create(  # type: ignore[misc]
                        model=MODEL, input=batch, encoding_format=fmt
                    ),
                    args.repeats,
                )
    result = {
        "benchmark": "embeddings",
        "date": dt.datetime.now(dt.UTC).isoformat(timespec="seconds"),
        "machine": {"cpus": os.cpu_count(), "processor": platform.processor() or platform.machine(),
                    "torch": torch.__version__, "load_average_1m": os.getloadavg()[0]},
        "model": MODEL,
        "batch": {"texts": len(batch), "tokens": tokens, "dimensions": 256},
        "repeats": args.repeats,
        "arms": arms,
    }  # fmt: skip
    print(json.dumps(result, indent=1))
    if args.json is not None:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
