"""The engine's decode against this CPU's limits, measured in one run.

Arms, interleaved (stream, ceiling, engine, ceiling, engine, ...) and repeated ``--runs``
times:
  stream        the machine's streamed bandwidth: the fastest of a sum, a matrix-vector
                product and a copy over a float32 buffer of several times the last-level
                cache (``--stream-llc-multiple``), on all of torch's threads. Batch-1
                decode reads every weight once (and the KV of its context): its
                bytes per step over the read bandwidth is the machine's true batch-1
                ceiling, whatever the weights' dtype or format
  ceiling-b1    the model's decode GEMMs at batch 1 (every weight matrix once: QKV, O,
                gate/up and down of each layer, then the LM head), ``F.linear`` in a loop
                (quantized weights: their own kernels), no attention, norms, sampling or
                Python around them: torch's own GEMM loop, a second reference. It is not a
                bandwidth: on a 2-core VM float32 GEMMs streamed 17.4 GB/s and bf16 ones
                34.1, so a percentage of it tracks how fast torch's kernels are, not memory
  engine-b1     one request decoding through the real engine (scheduler, runner, paged
                attention, sampler); only steps after its first token are timed
  ceiling-b64   the same GEMMs at batch 64: a compute ceiling for batch-64 decode
  engine-b64    64 requests decoding together; timed once all of them have their first
                token, so every timed step is 64 decodes
Batch 1 is reported as a fraction of the streamed bandwidth (``pct_b1_of_stream``: bytes a
step reads times steps per second over the streamed bandwidth) and of its GEMM ceiling; batch
64 of its ceiling. Targets (issue 34): batch 1 at least 70 % of the streamed bandwidth in
bf16 and with quantized weights, batch 64 at least 60 % of the GEMM ceiling in bf16. Then a
profile of one decode step at both batch sizes (``engine_profile.py``). ``--dtypes
float32,bfloat16,q4`` runs each in turn in one run (q4: the GGUF's quantized weights as the
worker runs them by default, float32 activations; SmolLM2's, or a random shape's quantized
the same way). ``--models llama3-1b``: Llama-3.2-1B's shape with random weights, whose step
reads enough bytes to be bound by them (roofline_models.py). The engine's attention
computes in float32 on the CPU, or in bf16 for a bf16 model on a CPU with native bf16
(``attention.compute_dtype``); the ceilings include no attention.

    python bench/engine_roofline.py [--quick] [--models smollm2,tiny,llama3-1b]
        [--dtypes float32,bfloat16,q4] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from engine_profile import profile_decode  # noqa: E402
from gpu.models import make_engine  # noqa: E402
from roofline_gemm import decode_ops, gemm_ceiling_s, matmul_params, step_weight_bytes  # noqa: E402
from roofline_models import RANDOM_SHAPES, random_model  # noqa: E402
from roofline_report import print_table  # noqa: E402
from roofline_stream import (  # noqa: E402
    MIB,
    STREAM_LLC_MULTIPLE,
    last_level_cache_bytes,
    stream_bandwidth,
)

from kvflow.engine_worker.app import build_worker  # noqa: E402
from kvflow.engine_worker.core.engine import Engine  # noqa: E402
from kvflow.engine_worker.core.sampling_params import SamplingParams  # noqa: E402
from kvflow.engine_worker.model.loader import load_model  # noqa: E402
from kvflow.engine_worker.settings import WorkerSettings  # noqa: E402

# ``--models`` naming a shape of roofline_models.py: random weights built in memory.
RANDOM = "random"
RANDOM_NAMES = ", ".join(RANDOM_SHAPES)


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def new_engine(loaded: Any, path: str | None, *, max_num_seqs: int) -> Engine:
    model, config = loaded
    if path == RANDOM:  # no checkpoint, no tokenizer: the engine as the GPU check builds it
        dtype = next(p.dtype for p in model.parameters() if p.is_floating_point())
        return make_engine(
            model, config, dtype=dtype, device="cpu", kv_cache_gib=0.75,
            max_num_seqs=max_num_seqs, max_num_batched_tokens=2048, max_model_len=4096,
        ).engine  # fmt: skip
    settings = WorkerSettings(
        model=path,  # in the dtype of the weights in ``loaded`` (``build_worker`` takes it)
        kv_cache_gib=0.75,
        max_num_seqs=max_num_seqs,
        max_num_batched_tokens=2048,
    )
    return build_worker(settings, loaded=loaded).engine


def engine_decode_steps_s(
    loaded: Any, path: str | None, *, batch: int, prompt_len: int, decode_steps: int, seed: int
) -> list[float]:
    """Seconds of each of ``decode_steps`` steps of ``batch`` requests that only decode.

    Prompts are ``prompt_len`` random tokens; the first token of each comes from its
    prefill and is not timed, nor are the steps until every request has it (requests
    prefilled in an earlier chunk are a step or two ahead, and may run further than
    ``decode_steps``: each may generate a few tokens more than are timed)."""
    config = loaded[1]
    engine = new_engine(loaded, path, max_num_seqs=batch)
    rng = random.Random(seed)
    for i in range(batch):
        prompt = [rng.randrange(3, config.vocab_size) for _ in range(prompt_len)]
        params = SamplingParams(temperature=0.0, max_tokens=decode_steps + 8, ignore_eos=True)
        engine.add_request(f"d{i}", prompt, params)
    started: set[str] = set()
    while len(started) < batch:
        started.update(out.request_id for out in engine.step() if out.new_tokens)
    step_s: list[float] = []
    for _ in range(decode_steps):
        start = time.perf_counter()
        outs = engine.step()
        step_s.append(time.perf_counter() - start)
        assert len(outs) == batch, f"a timed step decoded {len(outs)} of {batch} requests"
    return step_s


def summarize(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def bench_model(
    name: str, path: str | None, dtype: str, args: argparse.Namespace
) -> dict[str, Any]:
    log(f"{name}: loading ({dtype})")
    # Widened for float32 and bf16 (the GEMM ceiling's F.linear over float weights); q4: the
    # GGUF's quantized weights as the worker loads them by default, float32 activations.
    if path == RANDOM:
        loaded = random_model(name, dtype)
    elif dtype == "q4":
        if path is not None:
            raise SystemExit(f"--dtypes q4: {name} is no GGUF; q4 runs smollm2, {RANDOM_NAMES}")
        loaded = load_model(path, dtype=torch.float32, quantization="auto")
    else:
        loaded = load_model(path, dtype=getattr(torch, dtype), quantization="none")
    model, config = loaded
    act_dtype = torch.float32 if dtype == "q4" else getattr(torch, dtype)
    ops = decode_ops(model)
    weight_bytes = step_weight_bytes(model)
    prompt_len = 64 if args.quick else 128
    steps_b1 = 16 if args.quick else 48
    steps_b64 = 8 if args.quick else 24
    passes_b1 = 10 if args.quick else 20
    passes_b64 = 3 if args.quick else 6
    # KV a batch-1 step reads: K and V of every layer at the mean timed context (the
    # cache is in the model's dtype; attention may widen it to float32 as it reads).
    kv_elem = torch.tensor([], dtype=act_dtype).element_size()
    kv_per_token = 2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
    kv_bytes = kv_per_token * kv_elem * (prompt_len + steps_b1 / 2)
    step_bytes = weight_bytes + kv_bytes
    stream_bytes = min(
        max(args.stream_llc_multiple * last_level_cache_bytes(), 256 * MIB), 4096 * MIB
    )

    # Warm-up: one engine of each size, so the first timed run pays no first-call costs.
    engine_decode_steps_s(loaded, path, batch=1, prompt_len=16, decode_steps=4, seed=1)
    engine_decode_steps_s(loaded, path, batch=8, prompt_len=16, decode_steps=4, seed=1)
    runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        stream = stream_bandwidth(stream_bytes, 3 if args.quick else 5)
        c1 = gemm_ceiling_s(ops, 1, passes_b1, act_dtype)
        e1 = engine_decode_steps_s(
            loaded, path, batch=1, prompt_len=prompt_len, decode_steps=steps_b1, seed=run
        )
        c64 = gemm_ceiling_s(ops, 64, passes_b64, act_dtype)
        e64 = engine_decode_steps_s(
            loaded, path, batch=64, prompt_len=prompt_len, decode_steps=steps_b64, seed=run
        )
        # Tokens per second from the median pass and the median step: the same statistic
        # for both sides, robust to bursts from other jobs; the means are kept too.
        params = matmul_params(config)
        r = {
            "stream": stream,
            "stream_gb_s": stream["bandwidth_gb_s"],
            "stream_read_gb_s": stream["read_gb_s"],
            "stream_gemv_gb_s": stream["gemv_gb_s"],
            "stream_copy_gb_s": stream["copy_gb_s"],
            "stream_b1_tok_s": stream["bandwidth_gb_s"] * 1e9 / step_bytes,
            "ceiling_b1_pass_s": c1,
            "engine_b1_step_s": e1,
            "ceiling_b64_pass_s": c64,
            "engine_b64_step_s": e64,
            "ceiling_b1_tok_s": 1 / statistics.median(c1),
            "ceiling_b1_gb_s": weight_bytes / statistics.median(c1) / 1e9,
            "engine_b1_tok_s": 1 / statistics.median(e1),
            "engine_b1_mean_tok_s": len(e1) / sum(e1),
            "ceiling_b64_tok_s": 64 / statistics.median(c64),
            "ceiling_b64_gflop_s": 2 * 64 * params / statistics.median(c64) / 1e9,
            "engine_b64_tok_s": 64 / statistics.median(e64),
            "engine_b64_mean_tok_s": 64 * len(e64) / sum(e64),
        }
        # Batch 1 against the streamed bandwidth (the honest ceiling), and the GEMM loop's.
        r["engine_b1_gb_s"] = r["engine_b1_tok_s"] * step_bytes / 1e9
        r["pct_b1_of_stream"] = 100 * r["engine_b1_gb_s"] / r["stream_gb_s"]
        r["pct_b1_of_stream_best"] = 100 * r["engine_b1_gb_s"] / stream["bandwidth_best_gb_s"]
        r["pct_ceiling_b1_of_stream"] = 100 * r["ceiling_b1_gb_s"] / r["stream_gb_s"]
        r["pct_b1"] = 100 * r["engine_b1_tok_s"] / r["ceiling_b1_tok_s"]
        r["pct_b64"] = 100 * r["engine_b64_tok_s"] / r["ceiling_b64_tok_s"]
        r["pct_b1_of_means"] = 100 * r["engine_b1_mean_tok_s"] * sum(c1) / len(c1)
        r["pct_b64_of_means"] = 100 * r["engine_b64_mean_tok_s"] * sum(c64) / len(c64) / 64
        # The least disturbed pass and step (timeit's rule): on a machine whose load
        # changes for seconds at a time, medians can compare a quiet ceiling with a busy
        # engine, or the reverse.
        r["pct_b1_of_mins"] = 100 * min(c1) / min(e1)
        r["pct_b64_of_mins"] = 100 * min(c64) / min(e64)
        runs.append(r)
        log(
            f"{name} {dtype} run {run + 1}: stream {r['stream_gb_s']:.1f} GB/s; b1 "
            f"{r['engine_b1_tok_s']:.1f} tok/s = {r['engine_b1_gb_s']:.1f} GB/s "
            f"({r['pct_b1_of_stream']:.0f} % of stream; GEMM ceiling "
            f"{r['ceiling_b1_tok_s']:.1f}, {r['pct_b1']:.0f} %), b64 {r['engine_b64_tok_s']:.1f} "
            f"tok/s of {r['ceiling_b64_tok_s']:.1f} ({r['pct_b64']:.0f} %)"
        )
    summary = {
        k: summarize([r[k] for r in runs]) for k, v in runs[0].items() if isinstance(v, float)
    }
    profile = None
    if not args.no_profile:
        log(f"{name}: profiling decode steps")
        profile = {
            str(b): profile_decode(
                new_engine(loaded, path, max_num_seqs=b),
                vocab=config.vocab_size,
                batch=b,
                prompt_len=prompt_len,
                decode_steps=4 if args.quick else 8,
            )
            for b in (1, 64)
        }
    return {
        "model": name,
        "dtype": dtype,
        "weight_bytes": weight_bytes,
        "b1_step_bytes": step_bytes,
        "b1_kv_bytes": kv_bytes,
        "stream_bytes": stream_bytes,
        "last_level_cache_bytes": last_level_cache_bytes(),
        "prompt_len": prompt_len,
        "decode_steps": {"b1": steps_b1, "b64": steps_b64},
        "runs": runs,
        "summary": summary,
        "profile": profile,
    }


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--quick", action="store_true", help="shorter runs: about 2 minutes")
    parser.add_argument("--models", default="smollm2")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--no-profile", action="store_true")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16", "q4"),
        default="float32",
        help="the model's dtype; the ceilings use the same weights in it (q4: the GGUF's "
        "quantized weights)",
    )
    parser.add_argument(
        "--dtypes",
        help="several of float32,bfloat16,q4 in turn, in one run (default: --dtype)",
    )
    parser.add_argument(
        "--stream-llc-multiple",
        type=int,
        default=STREAM_LLC_MULTIPLE,
        help="the streamed-bandwidth buffer in multiples of the last-level cache",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    dtypes = (args.dtypes or args.dtype).split(",")
    for d in dtypes:
        if d not in ("float32", "bfloat16", "q4"):
            parser.error(f"--dtypes: unknown {d!r}; choose from float32, bfloat16, q4")
    import tempfile

    from engine_throughput import tiny_model

    torch.manual_seed(0)
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "threads": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "quick": args.quick,
        "dtypes": dtypes,
        "last_level_cache_bytes": last_level_cache_bytes(),
        "cpus": os.cpu_count(),
        "models": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name not in ("tiny", "smollm2", *RANDOM_SHAPES):
                parser.error(f"unknown model {name!r}: choose tiny, smollm2 or {RANDOM_NAMES}")
            path = tiny_model(Path(tmp)) if name == "tiny" else None
            if name in RANDOM_SHAPES:
                path = RANDOM
            for dtype in dtypes:
                report["models"].append(bench_model(name, path, dtype, args))
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
