"""Two versions of the model code, side by side in one process: which decode step is faster.

A change to the model that saves 5 % of a step is below what separate runs on a shared
machine can tell apart (the same code's batch-1 ratio to its ceiling moves 59-66 % between
runs minutes apart). So both versions decode in one process, on the same weights, KV cache
and request: the engine steps once with the model built from ``--old`` (a checkout's
``model/`` folder: ``llama.py``, ``attention.py``, ``rope.py``) and once with this checkout's,
alternating which goes first, with the GEMM ceiling of engine_roofline.py (at the same
batch) between every pair. Both write the same K/V into the same cache, so they stay in step.

    git worktree add /tmp/old <commit>
    python bench/engine_ab.py --old /tmp/old --steps 150 [--batch 1] [--json PATH]

Reports each arm's median step, its percentage of the ceiling (medians), and new / old.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import random
import statistics
import sys
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parent))

from engine_roofline import log, new_engine

from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.model.loader import load_model

MODEL_DIR = Path("engine_worker/kvflow/engine_worker/model")


def decode_linears(model: Any) -> list[Any]:
    """Every layer's projection one decode step runs, in the order the model does."""
    linears: list[Any] = []
    for layer in model.layers:
        attn, mlp = layer.self_attn, layer.mlp
        linears += [attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj]
    return linears


def decode_weights(model: Any) -> list[torch.Tensor]:
    """Every (widened) matrix one decode step multiplies by, in the order the model does."""
    weights: list[torch.Tensor] = [lin.weight for lin in decode_linears(model)]
    head = model.embed_tokens if model.lm_head is None else model.lm_head
    assert head.weight is not None, "the A/B measures widened weights"
    weights.append(head.weight)
    return weights


def _load(name: str, path: Path) -> ModuleType:
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None, path
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    spec.loader.exec_module(module)
    return module


def old_model(checkout: Path, config: Any, state: dict[str, torch.Tensor]) -> torch.nn.Module:
    """The checkout's ``LlamaForCausalLM`` with its own attention and RoPE, on these weights."""
    folder = checkout / MODEL_DIR
    attention = _load("old_attention", folder / "attention.py")
    rope = _load("old_rope", folder / "rope.py")
    llama = _load("old_llama", folder / "llama.py")
    llama.paged_attention = attention.paged_attention  # type: ignore[attr-defined]
    llama.RotaryEmbedding = rope.RotaryEmbedding  # type: ignore[attr-defined]
    model: torch.nn.Module = llama.LlamaForCausalLM(config)
    # Parameter names moved between versions (the embedding became a module of its own):
    # take each of the old model's parameters from the new one's of that name or its
    # ".weight". Buffers differ between versions and are left as the old code builds them.
    wanted = dict(model.named_parameters())
    renamed = {name: state[name] if name in state else state[f"{name}.weight"] for name in wanted}
    model.load_state_dict(renamed, strict=False)
    return model


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, required=True, help="a checkout of the old code")
    parser.add_argument("--steps", type=int, default=150)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    if not (args.old / MODEL_DIR / "llama.py").is_file():
        parser.error(f"{args.old / MODEL_DIR / 'llama.py'} not found: --old takes a checkout")

    log("loading SmolLM2 (the built-in model, widened: the old code's weights are float)")
    loaded = load_model(None, quantization="none")
    new, config = loaded
    old = old_model(args.old, config, new.state_dict())
    weights = decode_weights(new)
    inputs = {w.shape[1]: torch.randn(args.batch, w.shape[1], dtype=w.dtype) for w in weights}
    engine = new_engine(loaded, None, max_num_seqs=args.batch)
    runner: Any = engine.runner
    rng = random.Random(0)
    params = SamplingParams(temperature=0.0, max_tokens=2 * args.steps + 24, ignore_eos=True)
    for i in range(args.batch):
        prompt = [rng.randrange(3, config.vocab_size) for _ in range(args.prompt_len)]
        engine.add_request(f"r{i}", prompt, params)
    started: set[str] = set()
    while len(started) < args.batch:
        started.update(out.request_id for out in engine.step() if out.new_tokens)

    log(f"{args.steps} rounds of: ceiling pass, then a step of each arm (order alternating)")
    step_s: dict[str, list[float]] = {"ceiling": [], "old": [], "new": []}
    arms = (("new", new), ("old", old))
    with torch.inference_mode():
        for i in range(args.steps):
            start = time.perf_counter()
            for w in weights:
                F.linear(inputs[w.shape[1]], w)
            step_s["ceiling"].append(time.perf_counter() - start)
            for name, model in arms if i % 2 == 0 else arms[::-1]:
                runner.model = model
                start = time.perf_counter()
                outs = engine.step()
                step_s[name].append(time.perf_counter() - start)
                assert len(outs) == args.batch, f"a step decoded {len(outs)} of {args.batch}"
    runner.model = new

    medians = {name: statistics.median(values) for name, values in step_s.items()}
    report = {
        "old": str(args.old),
        "batch": args.batch,
        "steps": args.steps,
        "median_ms": {name: 1e3 * s for name, s in medians.items()},
        "pct_of_ceiling": {
            name: 100 * medians["ceiling"] / medians[name] for name in ("old", "new")
        },
        "new_over_old": medians["new"] / medians["old"],
        "step_s": step_s,
    }
    print("\n| arm | median ms | % of ceiling (medians) |\n|---|---|---|")
    print(f"| ceiling (GEMMs at batch {args.batch}) | {report['median_ms']['ceiling']:.1f} | |")
    for name in ("old", "new"):
        pct = report["pct_of_ceiling"][name]
        print(f"| {name} (batch {args.batch}) | {report['median_ms'][name]:.1f} | {pct:.1f} |")
    print(f"\nnew / old step time: {report['new_over_old']:.3f}")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
