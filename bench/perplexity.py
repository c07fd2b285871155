"""Perplexity through kvflow's own engine code, one arm per KV cache dtype, in one run.

The model runs as a worker runs it: ``build_worker`` builds the runner and its paged cache
(``--kv-cache-dtype`` as the arm says), and the text goes through ``model(...)`` over that
cache chunk by chunk, each chunk attending to the earlier ones through the cache, with
logits for every position. ``--chunks 512`` is the prefill path (512 is the default step
budget); ``--chunks 1`` feeds one token per step, the decode path, every token read back
from the cache. The perplexity is ``exp`` of the mean negative log-likelihood of each token
given those before it.

Besides perplexity, each arm reports how often its greedy choice (argmax) at a position
equals the unquantized cache's, the largest per-token NLL difference from it, and its KV
bytes per block and tokens per GiB (what the same memory buys).

The text (bench/data/, provenance in bench/data/README.md) is the Python Language
Reference's chapter "Execution model", 2,212 tokens for SmolLM2's tokenizer.

    python bench/perplexity.py [--models smollm2,smollm2-bf16] [--kv-dtypes auto,int8,fp8]
        [--chunks 512,1] [--max-tokens N] [--json PATH]

``smollm2`` is the built-in model in float32 (as ``--dtype auto`` runs a GGUF);
``smollm2-bf16`` the same weights in bfloat16 (a bf16 cache is what int8 halves).
"""

from __future__ import annotations

import argparse
import json
import math
import platform
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
TEXT = ROOT / "bench" / "data" / "python-3.11-execmodel.txt"
GIB = 1024**3

from arm_thread import in_thread  # noqa: E402

from kvflow.engine_worker.app import build_worker  # noqa: E402
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata  # noqa: E402
from kvflow.engine_worker.model.default_model import default_model_path  # noqa: E402
from kvflow.engine_worker.model.loader import load_model  # noqa: E402
from kvflow.engine_worker.settings import WorkerSettings  # noqa: E402

MODELS = {"smollm2": "float32", "smollm2-bf16": "bfloat16"}
BLOCK_SIZE = 16


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def cpu_model() -> str:
    """``lscpu``'s model name (what docs/benchmarks.md names a machine by)."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, check=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return platform.processor() or "unknown"
    for line in out.splitlines():
        if line.startswith("Model name:"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def tokenize(text: str) -> list[int]:
    """SmolLM2's tokenizer (the one in its GGUF, through transformers)."""
    import transformers

    transformers.logging.set_verbosity_error()
    gguf = default_model_path()
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    ids: list[int] = tok(text)["input_ids"]
    return ids


@torch.inference_mode()
def score(
    loaded: Any, kv_dtype: str, tokens: list[int], chunk: int
) -> tuple[torch.Tensor, torch.Tensor, Any]:
    """Negative log-likelihood of tokens[1:], each given those before it (float64 [n - 1]),
    the greedy choice at each position ([n - 1]) and the worker's memory report."""
    num_blocks = -(-len(tokens) // BLOCK_SIZE)
    settings = WorkerSettings(
        kv_cache_dtype=kv_dtype,
        num_kv_blocks=num_blocks,
        block_size=BLOCK_SIZE,
        max_model_len=len(tokens),
        decode_workspace_gib=0.0,
    )
    built = build_worker(settings, loaded=loaded)
    runner: Any = built.runner
    table = list(range(num_blocks))
    nlls, choices = [], []
    for start in range(0, len(tokens) - 1, chunk):
        end = min(start + chunk, len(tokens) - 1)  # the last token predicts nothing
        meta = AttentionMetadata.build(
            query_lens=[end - start],
            context_lens=[end],
            block_tables=[table],
            block_size=BLOCK_SIZE,
        )
        ids = torch.tensor(tokens[start:end])
        hidden = runner.model(ids, torch.arange(start, end), runner.kv_caches, meta)
        logits = runner.model.compute_logits(hidden).double()
        targets = torch.tensor(tokens[start + 1 : end + 1])
        nlls.append(-logits.log_softmax(-1).gather(1, targets[:, None])[:, 0])
        choices.append(logits.argmax(-1))
        if chunk == 1 and end % 512 == 0:
            log(f"    {end}/{len(tokens) - 1} tokens")
    return torch.cat(nlls), torch.cat(choices), built.memory


def run_model(name: str, args: argparse.Namespace, tokens: list[int]) -> dict[str, Any]:
    dtype = getattr(torch, MODELS[name])
    log(f"{name}: loading in {MODELS[name]}")
    loaded = load_model(None, dtype=dtype)
    arms: dict[str, Any] = {}
    for chunk in args.chunks:
        reference: tuple[torch.Tensor, torch.Tensor] | None = None
        for kv in args.kv_dtypes:
            log(f"{name}: --kv-cache-dtype {kv}, chunks of {chunk}")
            started = time.perf_counter()
            nll, choice, memory = in_thread(
                lambda kv=kv, chunk=chunk: score(loaded, kv, tokens, chunk),  # type: ignore[misc]
                name="score",
            )
            seconds = time.perf_counter() - started
            if reference is None:
                reference = nll, choice
            per_block = memory.kv_cache_bytes // memory.num_blocks
            arm = {
                "kv_cache_dtype": kv,
                "kv_layout": memory.kv_cache_dtype,
                "chunk_tokens": chunk,
                "num_scored_tokens": len(nll),
                "mean_nll": nll.mean().item(),
                "perplexity": math.exp(nll.mean().item()),
                "max_abs_nll_diff_vs_first": (nll - reference[0]).abs().max().item(),
                "greedy_agreement_vs_first": (choice == reference[1]).double().mean().item(),
                "kv_bytes_per_block": per_block,
                "tokens_per_gib": GIB // per_block * BLOCK_SIZE,
                "seconds": seconds,
            }
            arms[f"{kv}/chunk{chunk}"] = arm
            log(f"  perplexity {arm['perplexity']:.4f} in {seconds:.1f} s")
        base = arms[f"{args.kv_dtypes[0]}/chunk{chunk}"]
        for kv in args.kv_dtypes:
            arm = arms[f"{kv}/chunk{chunk}"]
            arm["perplexity_ratio_vs_first"] = arm["perplexity"] / base["perplexity"]
            arm["tokens_per_gib_ratio_vs_first"] = arm["tokens_per_gib"] / base["tokens_per_gib"]
    return {"model": name, "dtype": MODELS[name], "arms": arms}


def print_table(report: dict[str, Any]) -> None:
    print(
        f"\nperplexity on {report['text']} ({report['num_tokens']} tokens); "
        f"ratios against {report['kv_dtypes'][0]}"
    )
    header = (
        f"{'model':<13} {'KV dtype':<8} {'chunk':>5} {'perplexity':>10} {'ratio':>7} "
        f"{'max dNLL':>8} {'argmax=':>7} {'tokens/GiB':>11} {'x':>5}"
    )
    print(header)
    for m in report["models"]:
        for arm in m["arms"].values():
            print(
                f"{m['model']:<13} {arm['kv_cache_dtype']:<8} {arm['chunk_tokens']:>5} "
                f"{arm['perplexity']:>10.4f} {arm['perplexity_ratio_vs_first']:>7.4f} "
                f"{arm['max_abs_nll_diff_vs_first']:>8.3f} "
                f"{100 * arm['greedy_agreement_vs_first']:>6.1f}% {arm['tokens_per_gib']:>11,} "
                f"{arm['tokens_per_gib_ratio_vs_first']:>5.2f}"
            )


def main() -> int:
    p = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    p.add_argument("--models", default="smollm2,smollm2-bf16", help=f"any of {','.join(MODELS)}")
    p.add_argument("--kv-dtypes", default="auto,int8,fp8", help="the first is the reference")
    p.add_argument("--chunks", default="512,1", help="tokens per step: 512 prefill, 1 decode")
    p.add_argument("--max-tokens", type=int, help="score only the text's first N tokens")
    p.add_argument("--json", type=Path, help="write the results here")
    args = p.parse_args()
    args.kv_dtypes = args.kv_dtypes.split(",")
    args.chunks = [int(c) for c in args.chunks.split(",")]
    models = args.models.split(",")
    if unknown := set(models) - set(MODELS):
        p.error(f"unknown models {sorted(unknown)}: choose from {','.join(MODELS)}")
    tokens = tokenize(TEXT.read_text())[: args.max_tokens]
    report: dict[str, Any] = {
        "machine": {
            "cpu": cpu_model(),
            "threads": torch.get_num_threads(),
            "platform": platform.platform(),
            "torch": torch.__version__,
        },
        "started_utc": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        "command": " ".join(sys.argv),
        "text": str(TEXT.relative_to(ROOT)),
        "num_tokens": len(tokens),
        "kv_dtypes": args.kv_dtypes,
        "models": [run_model(name, args, tokens) for name in models],
    }
    print_table(report)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
