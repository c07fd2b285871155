"""Engine throughput and prefix-caching TTFT, side by side in one run.

Arms, same model, same prompts, greedy decoding, each request generating exactly its
drawn number of tokens:
  kvflow        our engine, every request submitted at once (continuous batching)
  hf-serial     transformers `generate`, one request at a time
  hf-static     transformers `generate` on one static left-padded batch of all requests
                (it runs until the longest request is done: the padding and finished rows
                are the waste continuous batching removes; useful tokens are counted)
Then the TTFT of prompts that share 97 % of their tokens, with prefix caching on vs off.

    python bench/engine_throughput.py [--quick] [--models tiny,smollm2] [--json PATH]

Ratios are what to read: every arm runs in this process, on the same machine state.
"""

from __future__ import annotations

import argparse
import json
import platform
import random
import statistics
import sys
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from kvflow.engine_worker.app import build_worker  # noqa: E402
from kvflow.engine_worker.core.engine import Engine  # noqa: E402
from kvflow.engine_worker.core.sampling_params import SamplingParams  # noqa: E402
from kvflow.engine_worker.model.default_model import default_model_path  # noqa: E402
from kvflow.engine_worker.model.loader import load_model  # noqa: E402
from kvflow.engine_worker.settings import WorkerSettings  # noqa: E402


@dataclass(frozen=True)
class Workload:
    prompts: list[list[int]]
    output_lens: list[int]

    @property
    def num_output_tokens(self) -> int:
        return sum(self.output_lens)


@dataclass
class ArmResult:
    arm: str
    wall_s: float
    output_tokens: int

    @property
    def tokens_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)


def make_workload(num: int, low: int, high: int, vocab: int, seed: int) -> Workload:
    rng = random.Random(seed)
    lens = [(rng.randint(low, high), rng.randint(low, high)) for _ in range(num)]
    # Token ids from 3 up: clear of the special tokens a real tokenizer puts first.
    prompts = [[rng.randrange(3, vocab) for _ in range(p)] for p, _ in lens]
    return Workload(prompts, [o for _, o in lens])


def new_engine(model: str | None, loaded: Any, **overrides: Any) -> Engine:
    settings = WorkerSettings(
        model=model, kv_cache_gib=overrides.pop("kv_cache_gib", 2.0), **overrides
    )
    return build_worker(settings, loaded=loaded).engine


def run_kvflow(engine: Engine, w: Workload) -> ArmResult:
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        engine.add_request(
            f"r{i}", prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True)
        )
    start = time.perf_counter()
    produced = 0
    while engine.has_unfinished_requests:
        for out in engine.step():
            produced += len(out.new_tokens)
    wall = time.perf_counter() - start
    assert produced == w.num_output_tokens, (produced, w.num_output_tokens)
    return ArmResult("kvflow", wall, produced)


def run_hf_serial(hf: Any, w: Workload, progress: Callable[[int], None]) -> ArmResult:
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] == len(prompt) + n
        progress(i)
    return ArmResult("hf-serial", time.perf_counter() - start, w.num_output_tokens)


def run_hf_static(hf: Any, w: Workload) -> ArmResult:
    longest = max(len(p) for p in w.prompts)
    ids = torch.zeros(len(w.prompts), longest, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(w.prompts):  # left padding, as decoder-only batching needs
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    n = max(w.output_lens)
    start = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    wall = time.perf_counter() - start
    assert out.shape[1] == longest + n
    return ArmResult("hf-static", wall, w.num_output_tokens)


def ttft_prefix_caching(
    model: str | None, loaded: Any, *, vocab: int, prompt_len: int, num_prompts: int, seed: int
) -> dict[str, Any]:
    """TTFT of prompts sharing 97 % of their tokens, one at a time (no queueing)."""
    rng = random.Random(seed)
    shared_len = round(prompt_len * 0.97)
    shared = [rng.randrange(3, vocab) for _ in range(shared_len)]
    prompts = [
        shared + [rng.randrange(3, vocab) for _ in range(prompt_len - shared_len)]
        for _ in range(num_prompts)
    ]
    result: dict[str, Any] = {"prompt_len": prompt_len, "shared_len": shared_len}
    for caching in (False, True):
        engine = new_engine(
            model,
            loaded,
            enable_prefix_caching=caching,
            max_num_batched_tokens=prompt_len,
            max_model_len=4096,
        )
        ttfts = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            start = time.perf_counter()
            while engine.has_unfinished_requests:
                engine.step()
            ttfts.append(time.perf_counter() - start)
        # The first prompt fills the cache in both arms; the others are what caching serves.
        key = "on" if caching else "off"
        result[f"ttft_{key}_first_s"] = ttfts[0]
        result[f"ttft_{key}_median_s"] = statistics.median(ttfts[1:])
    result["ttft_speedup"] = result["ttft_off_median_s"] / result["ttft_on_median_s"]
    return result


def bench_model(
    name: str, path: str | None, hf_loader: Callable[[], Any], args: argparse.Namespace
) -> dict[str, Any]:
    log(f"{name}: loading")
    loaded = load_model(path)
    config = loaded[1]
    hf = hf_loader()
    if args.quick:
        w = make_workload(16, 16, 64, config.vocab_size, args.seed)
    else:
        w = make_workload(args.num_requests, 32, 256, config.vocab_size, args.seed)
    log(f"{name}: {len(w.prompts)} requests, {w.num_output_tokens} output tokens")

    warm = make_workload(2, 8, 16, config.vocab_size, args.seed + 1)
    run_kvflow(new_engine(path, loaded, max_num_seqs=64), warm)
    run_hf_static(hf, warm)

    results = [run_kvflow(new_engine(path, loaded, max_num_seqs=64), w)]
    log(f"{name}: kvflow {results[-1].tokens_per_s:.1f} tok/s")
    results.append(run_hf_static(hf, w))
    log(f"{name}: hf-static {results[-1].tokens_per_s:.1f} tok/s")
    step = max(1, len(w.prompts) // 8)
    results.append(
        run_hf_serial(
            hf,
            w,
            lambda i: (i + 1) % step == 0 and log(f"{name}: hf-serial {i + 1}/{len(w.prompts)}"),
        )
    )
    log(f"{name}: hf-serial {results[-1].tokens_per_s:.1f} tok/s")

    by_arm = {r.arm: r for r in results}
    ttft = ttft_prefix_caching(
        path,
        loaded,
        vocab=config.vocab_size,
        prompt_len=256 if args.quick else 1024,
        num_prompts=4 if args.quick else 8,
        seed=args.seed,
    )
    log(f"{name}: prefix caching TTFT {ttft['ttft_speedup']:.1f}x")
    return {
        "model": name,
        "num_requests": len(w.prompts),
        "output_tokens": w.num_output_tokens,
        "arms": {r.arm: {**asdict(r), "tokens_per_s": r.tokens_per_s} for r in results},
        "ratio_vs_hf_serial": by_arm["kvflow"].tokens_per_s / by_arm["hf-serial"].tokens_per_s,
        "ratio_vs_hf_static": by_arm["kvflow"].tokens_per_s / by_arm["hf-static"].tokens_per_s,
        "prefix_caching": ttft,
    }


def tiny_model(tmp: Path) -> str:
    from testkit.tiny_model import write_tiny_llama

    # The 56 M Llama of ../shared/facts/engine-notes.md: 8 layers, hidden 512, vocab 32k.
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
    parser.add_argument("--quick", action="store_true", help="16 short requests: a few minutes")
    parser.add_argument("--models", default="tiny,smollm2")
    parser.add_argument("--num-requests", type=int, default=64)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--json", type=Path, help="write the results here")
    args = parser.parse_args()
    import tempfile

    import transformers

    transformers.logging.set_verbosity_error()
    torch.manual_seed(args.seed)
    report: dict[str, Any] = {
        "machine": {
            "platform": platform.platform(),
            "cpus": torch.get_num_threads(),
            "torch": torch.__version__,
        },
        "quick": args.quick,
        "models": [],
    }
    with tempfile.TemporaryDirectory() as tmp:
        for name in args.models.split(","):
            if name == "tiny":
                path: str | None = tiny_model(Path(tmp))
                loader = lambda p=path: transformers.LlamaForCausalLM.from_pretrained(p).eval()  # noqa: E731
            elif name == "smollm2":
                path = None
                gguf = default_model_path()
                loader = lambda g=gguf: transformers.AutoModelForCausalLM.from_pretrained(  # noqa: E731
                    str(g.parent), gguf_file=g.name, torch_dtype=torch.float32
                ).eval()
            else:
                parser.error(f"unknown model {name!r}: choose tiny or smollm2")
            report["models"].append(bench_model(name, path, loader, args))

    print()
    print(
        "| model | requests | kvflow tok/s | hf-static tok/s | hf-serial tok/s "
        "| vs serial | vs static | prefix-cache TTFT |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for m in report["models"]:
        a = m["arms"]
        print(
            f"| {m['model']} | {m['num_requests']} | {a['kvflow']['tokens_per_s']:.1f} | "
            f"{a['hf-static']['tokens_per_s']:.1f} | {a['hf-serial']['tokens_per_s']:.1f} | "
            f"{m['ratio_vs_hf_serial']:.2f}x | {m['ratio_vs_hf_static']:.2f}x | "
            f"{m['prefix_caching']['ttft_speedup']:.1f}x |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=2) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
