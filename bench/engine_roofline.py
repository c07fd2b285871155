"""The engine's decode against this CPU's limits, measured in one run.

Arms, interleaved (ceiling, engine, ceiling, engine, ...) and repeated ``--runs`` times:
  ceiling-b1    the model's decode GEMMs at batch 1 (every weight matrix once: QKV, O,
                gate/up and down of each layer, then the LM head), ``F.linear`` in a loop,
                no attention, norms, sampling or Python around them: the time to stream
                the weights once, a bandwidth ceiling for batch-1 decode
  engine-b1     one request decoding through the real engine (scheduler, runner, paged
                attention, sampler); only steps after its first token are timed
  ceiling-b64   the same GEMMs at batch 64: a compute ceiling for batch-64 decode
  engine-b64    64 requests decoding together; timed once all of them have their first
                token, so every timed step is 64 decodes
Each engine arm is reported as a percentage of its ceiling's tokens per second; the
targets (issue 12) are 70 % at batch 1 and 60 % at batch 64 for SmolLM2. Then a profile of
one decode step at both batch sizes (``engine_profile.py``). ``--dtype bfloat16`` runs the
model and its ceilings in bf16; the engine's attention still computes in float32 on the CPU
(``attention.compute_dtype``), which the ceilings do not include.

    python bench/engine_roofline.py [--quick] [--models smollm2,tiny] [--dtype bfloat16]
        [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from engine_profile import profile_decode  # noqa: E402

from kvflow.engine_worker.app import build_worker  # noqa: E402
from kvflow.engine_worker.core.engine import Engine  # noqa: E402
from kvflow.engine_worker.core.sampling_params import SamplingParams  # noqa: E402
from kvflow.engine_worker.model.llama import LlamaForCausalLM  # noqa: E402
from kvflow.engine_worker.model.loader import load_model  # noqa: E402
from kvflow.engine_worker.settings import WorkerSettings  # noqa: E402


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def decode_weights(model: LlamaForCausalLM) -> list[torch.Tensor]:
    """Every matrix one decode step multiplies by, in the order the model does."""
    weights: list[torch.Tensor] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        weights += [
            attn.qkv_proj.weight,
            attn.o_proj.weight,
            mlp.gate_up_proj.weight,
            mlp.down_proj.weight,
        ]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    assert head.weight is not None, "the roofline measures widened weights"
    weights.append(head.weight)
    return weights


def gemm_ceiling_s(weights: list[torch.Tensor], batch: int, passes: int) -> list[float]:
    """Seconds of each pass of ``F.linear`` over every weight at this batch size.

    Inputs are preallocated per input width and nothing depends on a previous output, so
    this is the GEMMs alone; a warm-up pass comes first."""
    inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=w.dtype) for w in weights}
    times: list[float] = []
    with torch.inference_mode():
        for i in range(passes + 1):
            start = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            if i:  # the first pass is the warm-up
                times.append(time.perf_counter() - start)
    return times


def new_engine(loaded: Any, path: str | None, *, max_num_seqs: int) -> Engine:
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


def bench_model(name: str, path: str | None, args: argparse.Namespace) -> dict[str, Any]:
    log(f"{name}: loading ({args.dtype})")
    # Widened: the ceilings are float GEMMs over float weights.
    loaded = load_model(path, dtype=getattr(torch, args.dtype), quantization="none")
    model, config = loaded
    weights = decode_weights(model)
    weight_bytes = sum(w.numel() * w.element_size() for w in weights)
    prompt_len = 64 if args.quick else 128
    steps_b1 = 16 if args.quick else 48
    steps_b64 = 8 if args.quick else 24
    passes_b1 = 10 if args.quick else 20
    passes_b64 = 3 if args.quick else 6

    # Warm-up: one engine of each size, so the first timed run pays no first-call costs.
    engine_decode_steps_s(loaded, path, batch=1, prompt_len=16, decode_steps=4, seed=1)
    engine_decode_steps_s(loaded, path, batch=8, prompt_len=16, decode_steps=4, seed=1)
    runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        c1 = gemm_ceiling_s(weights, 1, passes_b1)
        e1 = engine_decode_steps_s(
            loaded, path, batch=1, prompt_len=prompt_len, decode_steps=steps_b1, seed=run
        )
        c64 = gemm_ceiling_s(weights, 64, passes_b64)
        e64 = engine_decode_steps_s(
            loaded, path, batch=64, prompt_len=prompt_len, decode_steps=steps_b64, seed=run
        )
        # Tokens per second from the median pass and the median step: the same statistic
        # for both sides, robust to bursts from other jobs; the means are kept too.
        params = weight_bytes / w_elem(weights)
        r = {
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
            f"{name} run {run + 1}: b1 {r['engine_b1_tok_s']:.1f} tok/s of "
            f"{r['ceiling_b1_tok_s']:.1f} ({r['pct_b1']:.0f} %), b64 {r['engine_b64_tok_s']:.1f} "
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
        "weight_bytes": weight_bytes,
        "prompt_len": prompt_len,
        "decode_steps": {"b1": steps_b1, "b64": steps_b64},
        "runs": runs,
        "summary": summary,
        "profile": profile,
    }


def w_elem(weights: list[torch.Tensor]) -> int:
    """Bytes per weight element (all weights share the model's dtype)."""
    return weights[0].element_size()


def print_table(report: dict[str, Any]) -> None:
    print()
    print(
        "| model | b1 engine tok/s | b1 ceiling tok/s (GB/s) | b1 % | "
        "b64 engine tok/s | b64 ceiling tok/s (GFLOP/s) | b64 % | b1 / b64 % of means | of mins |"
    )
    print("|---|---|---|---|---|---|---|---|---|")

    def cell(s: dict[str, float], fmt: str = ".1f") -> str:
        return f"{s['median']:{fmt}} ({s['min']:{fmt}}-{s['max']:{fmt}})"

    for m in report["models"]:
        s = m["summary"]
        print(
            f"| {m['model']} | {cell(s['engine_b1_tok_s'])} | {cell(s['ceiling_b1_tok_s'])} "
            f"({s['ceiling_b1_gb_s']['median']:.1f}) | {cell(s['pct_b1'], '.0f')} | "
            f"{cell(s['engine_b64_tok_s'])} | {cell(s['ceiling_b64_tok_s'])} "
            f"({s['ceiling_b64_gflop_s']['median']:.0f}) | {cell(s['pct_b64'], '.0f')} | "
            f"{cell(s['pct_b1_of_means'], '.0f')} / {cell(s['pct_b64_of_means'], '.0f')} | "
            f"{cell(s['pct_b1_of_mins'], '.0f')} / {cell(s['pct_b64_of_mins'], '.0f')} |"
        )
    for m in report["models"]:
        for batch, p in (m["profile"] or {}).items():
            print(f"\n{m['model']}, batch {batch}: ms per decode step")
            for part, ms in p["ms_per_step"].items():
                print(f"  {part:<28} {ms:8.2f}  ({100 * ms / p['ms_per_step']['step']:.0f} %)")


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
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype; the ceilings use the same weights in it",
    )
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
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
        "dtype": args.dtype,
        "models": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name not in ("tiny", "smollm2"):
                parser.error(f"unknown model {name!r}: choose tiny or smollm2")
            path = tiny_model(Path(tmp)) if name == "tiny" else None
            report["models"].append(bench_model(name, path, args))
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
