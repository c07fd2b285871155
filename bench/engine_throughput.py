"""Engine throughput and prefix-caching TTFT, side by side in one run.

Arms, same model, same prompts, greedy decoding, each request generating exactly its
drawn number of tokens, every request submitted at once:
  kvflow        our engine (continuous batching), a fresh engine per run
  kvflow-warm   the same engine for every run, as a worker that has served a batch like
                this one: primed once, untimed, on a workload of the same shape and tokens
                of its own, and its prefix cache emptied before each run (a fresh engine
                writes its decode workspace into fresh memory inside the timed run, where
                hf-cb has zeroed its cache before its timer starts)
  kvflow-workspace the same with decodes through the decode workspace's dense copies and
                SDPA (--no-paged-attention), as before the CPU's paged kernel (2026-12-06)
  kvflow-gather the same with neither (--no-paged-attention --decode-workspace-gib 0):
                decode attention gathers each sequence's blocks every step, as before
                2026-12-01
  kvflow-fp32   our engine in float32 whatever --dtype says: with --dtype bfloat16, what
                bf16 buys on this CPU
  kvflow-widened our engine over a GGUF's weights widened to --dtype at load
                (--quantization none), as kvflow ran GGUFs before they stayed quantized
                (4-bit planes, torch's int4 kernels); GGUF models only
  kvflow-int8   our engine with an int8 KV cache (--kv-cache-dtype int8), and kvflow-fp8
  kvflow-fp8    with an fp8 one: what dequantizing the cache costs (not in the default arms)
  hf-cb-fp32    hf-cb in float32 whatever --dtype says: transformers' other choice
  hf-cb         transformers' own continuous batching (``init_continuous_batching``), a
                fresh manager per run, warmed up, its KV cache sized to the workload
  hf-static     transformers `generate` on one static left-padded batch of all requests
                (it runs until the longest request is done: the padding and finished rows
                are the waste continuous batching removes; useful tokens are counted)
  hf-serial     transformers `generate`, one request at a time
Every arm but the -fp32 ones runs the model in ``--dtype`` (float32 by default), and every
kvflow arm but -int8 and -fp8 its KV cache in ``--kv-cache-dtype`` (auto: the model's). The arms run
interleaved ``--runs`` times (the order rotated each run); each arm is reported as the
median and range of its runs, with kvflow's ratios of medians. Then the
TTFT of prompts that share 97 % of their tokens, with prefix caching on vs off.

    python bench/engine_throughput.py [--quick] [--models tiny,smollm2] [--runs 3]
        [--dtype float32|bfloat16] [--kv-cache-dtype auto|int8|fp8] [--json PATH]
Ratios are what to read: every arm runs in this process, each in a thread of its own."""

from __future__ import annotations

import argparse
import json
import os
import platform
import resource
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "bench"))
sys.path.insert(0, str(ROOT / "tests"))

from arm_thread import in_thread  # noqa: E402
from hf_arms import run_hf_cb, run_hf_serial, run_hf_static  # noqa: E402
from kvflow_arms import WarmEngine, new_engine, run_kvflow  # noqa: E402
from prefix_ttft import ttft_prefix_caching  # noqa: E402
from throughput_report import BASES, print_table  # noqa: E402
from throughput_stats import (  # noqa: E402
    FULL,
    QUICK,
    Workload,
    WorkloadSpec,
    make_workload,
    ratio_spread,
    ratios_of_medians,
    rotated,
    summarize_runs,
    token_range,
)

from kvflow.engine_worker.model.default_model import default_model_path  # noqa: E402
from kvflow.engine_worker.model.loader import load_model  # noqa: E402

ARMS = (
    "kvflow",
    "kvflow-warm",
    "kvflow-workspace",
    "kvflow-gather",
    "kvflow-fp32",
    "kvflow-widened",
    "hf-cb",
    "hf-cb-fp32",
    "hf-static",
    "hf-serial",
    "kvflow-int8",
    "kvflow-fp8",
)
DEFAULT_ARMS = ARMS[:-2]  # the KV-dtype arms on request
# Our engine's batch size (transformers' manager takes every request at once, hf_arms.py).
MAX_SEQS = 64


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def minor_faults() -> int:
    """Page faults this process took without I/O: first writes to fresh memory among them,
    which on a VM whose freed memory goes back to the host cost several microseconds each."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt


def load1() -> float:
    return os.getloadavg()[0]


def bench_model(
    name: str, path: str | None, hf_loader: Callable[[torch.dtype], Any], args: argparse.Namespace
) -> dict[str, Any]:
    log(f"{name}: loading ({args.dtype})")
    dtype = getattr(torch, args.dtype)
    loaded = load_model(path, dtype=dtype)
    # The -fp32 arms' models: the same weights in float32, loaded only when those arms run.
    want_fp32 = dtype != torch.float32 and bool({"kvflow-fp32", "hf-cb-fp32"} & set(args.arms))
    loaded_fp32 = load_model(path) if want_fp32 else loaded
    # kvflow-widened: a GGUF's quantized weights widened to the model's dtype at load (how
    # kvflow ran GGUFs before they stayed quantized); a folder has none to widen.
    is_gguf = path is None or path.endswith(".gguf")
    want_widened = "kvflow-widened" in args.arms and is_gguf
    loaded_widened = load_model(path, dtype=dtype, quantization="none") if want_widened else None
    config = loaded[1]
    hf = hf_loader(dtype)
    hf_fp32 = hf_loader(torch.float32) if want_fp32 else hf
    spec: WorkloadSpec = QUICK if args.quick else FULL
    spec = WorkloadSpec(
        args.num_requests if args.num_requests is not None else spec.num_requests,
        args.prompt_len or spec.prompt_len,
        args.output_len or spec.output_len,
    )
    w = make_workload(spec, config.vocab_size, args.seed)
    log(
        f"{name}: {len(w.prompts)} requests, {w.num_output_tokens} output tokens "
        f"({100 * w.static_useful_fraction:.0f} % of a static batch's output slots)"
    )
    step = max(1, len(w.prompts) // 4)
    primer = make_workload(spec, config.vocab_size, args.seed + 2)
    kv = args.kv_cache_dtype
    warm_engine = WarmEngine(
        lambda: new_engine(path, loaded, max_num_seqs=MAX_SEQS, kv_cache_dtype=kv), primer
    )
    arms: dict[str, Callable[[Workload], tuple[float, int]]] = {
        "kvflow": lambda wl: run_kvflow(
            new_engine(path, loaded, max_num_seqs=MAX_SEQS, kv_cache_dtype=kv), wl
        ),
        "kvflow-warm": warm_engine.run,
        "kvflow-workspace": lambda wl: run_kvflow(
            new_engine(
                path, loaded, max_num_seqs=MAX_SEQS, paged_attention=False, kv_cache_dtype=kv
            ),
            wl,
        ),
        "kvflow-gather": lambda wl: run_kvflow(
            new_engine(
                path,
                loaded,
                max_num_seqs=MAX_SEQS,
                paged_attention=False,
                decode_workspace_gib=0.0,
                kv_cache_dtype=kv,
            ),
            wl,
        ),
        "kvflow-fp32": lambda wl: run_kvflow(
            new_engine(path, loaded_fp32, max_num_seqs=MAX_SEQS, kv_cache_dtype=kv), wl
        ),
        "kvflow-int8": lambda wl: run_kvflow(
            new_engine(path, loaded, max_num_seqs=MAX_SEQS, kv_cache_dtype="int8"), wl
        ),
        "kvflow-fp8": lambda wl: run_kvflow(
            new_engine(path, loaded, max_num_seqs=MAX_SEQS, kv_cache_dtype="fp8"), wl
        ),
        "kvflow-widened": lambda wl: run_kvflow(
            new_engine(path, loaded_widened, max_num_seqs=MAX_SEQS), wl
        ),
        "hf-cb": lambda wl: run_hf_cb(hf, wl),
        "hf-cb-fp32": lambda wl: run_hf_cb(hf_fp32, wl),
        "hf-static": lambda wl: run_hf_static(hf, wl),
        "hf-serial": lambda wl: run_hf_serial(
            hf, wl, lambda i: (i + 1) % step == 0 and log(f"  hf-serial {i + 1}/{len(wl.prompts)}")
        ),
    }
    chosen = [a for a in ARMS if a in args.arms and (a != "kvflow-widened" or want_widened)]

    # Warm-up of every arm on two short requests: first-call costs are paid here.
    warm = make_workload(WorkloadSpec(2, (8, 16), (8, 16)), config.vocab_size, args.seed + 1)
    for arm in chosen:
        in_thread(lambda a=arm: arms[a](warm))

    runs: list[dict[str, Any]] = []
    for run in range(args.runs):
        order = rotated(chosen, run)
        record: dict[str, Any] = {"order": order, "arms": {}}
        for arm in order:
            before, faults = load1(), minor_faults()
            wall, produced = in_thread(lambda a=arm: arms[a](w))
            faults = minor_faults() - faults
            record["arms"][arm] = {
                "wall_s": wall,
                "output_tokens": produced,
                "tokens_per_s": produced / wall,
                "load1_before": before,
                "load1_after": load1(),
                "minor_faults": faults,
            }
            log(f"{name} run {run + 1}: {arm} {produced / wall:.1f} tok/s (load {before:.1f})")
        runs.append(record)

    tok_s = [{arm: r["tokens_per_s"] for arm, r in run["arms"].items()} for run in runs]
    summary = summarize_runs(tok_s)
    result: dict[str, Any] = {
        "model": name,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "workload": {
            "num_requests": spec.num_requests,
            "prompt_len": list(spec.prompt_len),
            "output_len": list(spec.output_len),
            "output_tokens": w.num_output_tokens,
            "static_useful_fraction": w.static_useful_fraction,
        },
        "runs": runs,
        "summary_tokens_per_s": summary,
    }
    for base in BASES:
        if base in summary:
            key = base.replace("-", "_")
            result[f"{key}_ratio_of_medians"] = ratios_of_medians(summary, base)
            result[f"{key}_ratio_per_run"] = {
                arm: ratio_spread(tok_s, base, arm) for arm in summary if arm != base
            }
    if not args.no_ttft:
        result["prefix_caching"] = ttft_prefix_caching(
            path,
            loaded,
            vocab=config.vocab_size,
            prompt_len=256 if args.quick else 1024,
            num_prompts=4 if args.quick else 8,
            seed=args.seed,
        )
        log(f"{name}: prefix caching TTFT {result['prefix_caching']['ttft_speedup']:.1f}x")
    return result


def tiny_model(tmp: Path) -> str:
    from testkit.tiny_model import write_tiny_llama

    # A 56 M Llama: 8 layers, hidden 512, vocab 32k.
    return str(
        write_tiny_llama(
            tmp / "tiny-56m",
            seed=0,
            vocab_size=32000,
            hidden_size=512,
            intermediate_size=1376,
            num_hidden_layers=8,
            num_attention_heads=8,
            num_key_value_heads=8,
        )
    )


def main() -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument(
        "--quick",
        action="store_true",
        help="64 requests of 16-128 prompt and output tokens (half the full lengths)",
    )
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--arms", default=",".join(DEFAULT_ARMS), help=f"any of {','.join(ARMS)}")
    parser.add_argument("--runs", type=int, default=3, help="interleaved runs of the arms")
    parser.add_argument("--num-requests", type=int, help="override the workload's count")
    parser.add_argument(
        "--prompt-len", type=token_range, help="override the prompt lengths: LO,HI tokens"
    )
    parser.add_argument(
        "--output-len", type=token_range, help="override the output lengths: LO,HI tokens"
    )
    parser.add_argument("--no-ttft", action="store_true", help="skip the prefix-caching TTFT")
    parser.add_argument(
        "--dtype",
        choices=("float32", "bfloat16"),
        default="float32",
        help="the model's dtype in every arm but kvflow-fp32 (ours and transformers')",
    )
    parser.add_argument(
        "--kv-cache-dtype",
        choices=("auto", "int8", "fp8"),
        default="auto",
        help="the KV cache of every kvflow arm but kvflow-int8 and kvflow-fp8",
    )
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    args.arms = args.arms.split(",")
    if unknown := set(args.arms) - set(ARMS):
        parser.error(f"unknown arms {sorted(unknown)}: choose from {','.join(ARMS)}")
    import tempfile

    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
            "transformers": transformers.__version__,
        },
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "quick": args.quick,
        "dtype": args.dtype,
        "kv_cache_dtype": args.kv_cache_dtype,
        "runs": args.runs,
        "load1_at_start": load1(),
        "models": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "tiny":
                path: str | None = tiny_model(Path(tmp))
                loader = lambda dtype, p=path: transformers.LlamaForCausalLM.from_pretrained(  # noqa: E731
                    p, torch_dtype=dtype
                ).eval()
            elif name == "smollm2":
                path = None
                gguf = default_model_path()
                loader = lambda dtype, g=gguf: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
                    str(g.parent), gguf_file=g.name, torch_dtype=dtype
                ).eval()
            else:
                parser.error(f"unknown model {name!r}: choose tiny or smollm2")
            report["models"].append(bench_model(name, path, loader, args))
    report["load1_at_end"] = load1()
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
