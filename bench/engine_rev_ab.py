"""Two checkouts of the engine, run alternately: each one's decode step as a percentage of
torch's GEMM loop over the same weights, measured in the same process, and new / old.

``engine_ab.py`` swaps the model code in one process, which cannot compare changes that
reach past the model (the decode workspace's dtype is the runner's choice). This runs each
checkout in a process of its own, alternating old and new (the order flipping every round),
and in each process interleaves a GEMM-ceiling pass (engine_roofline.py's ``F.linear`` over
every decode matrix) with every engine step, so each arm's percentage of the ceiling is a
ratio taken under the same load. On a shared machine the absolute step times move with
whatever else runs; the per-round ratios are what to read.

    git archive <commit> engine_worker proto | tar -x -C /tmp/old
    python bench/engine_rev_ab.py --old /tmp/old --dtype bfloat16 --rounds 4 \\
        [--threads 1] [--batches 64,1] [--json PATH]

``--dtype q4`` runs the GGUF's 4-bit weights as the worker does (float32 activations), its
ceiling a float32 GEMM over dense weights of the same shapes.

``--threads`` sets torch's threads in the probes (default: torch's own): on a 2-core VM that
other jobs share, two threads spin at every op's barrier for a descheduled partner (a
64 x 576 multiply took 12 ms instead of 4 us), so one thread measures the code, not the
neighbours.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parent.parent
SOURCE_ROOTS = ("proto", "engine_worker", "router", "operator", "cli")


def probe(dtype_name: str, batches: list[int], steps: int, prompt_len: int) -> dict[str, Any]:
    """In this process's checkout: per batch, ``steps`` rounds of a ceiling pass and an
    engine step of ``batch`` decodes; medians and the percentage of the ceiling."""
    import torch
    import torch.nn.functional as F

    sys.path.insert(0, str(ROOT / "bench"))
    from engine_ab import decode_linears, decode_weights
    from engine_roofline import new_engine

    from kvflow.engine_worker.core.sampling_params import SamplingParams
    from kvflow.engine_worker.model import llama
    from kvflow.engine_worker.model.loader import load_model

    if dtype_name == "q4":
        # The GGUF's 4-bit weights as the worker runs them (float32 activations); the
        # ceiling is a float32 GEMM over dense weights of the same shapes: the machine's
        # speed at this batch, the same reference for both checkouts.
        dtype = torch.float32
        loaded = load_model(None, dtype=dtype, quantization="auto")
        model, config = loaded
        weights = [torch.randn(w.out_features, w.in_features) for w in decode_linears(model)]
        weights.append(torch.randn(config.vocab_size, config.hidden_size))
    else:
        dtype = getattr(torch, dtype_name)
        loaded = load_model(None, dtype=dtype, quantization="none")
        model, config = loaded
        weights = decode_weights(model)
    out: dict[str, Any] = {"source": llama.__file__, "threads": torch.get_num_threads()}
    for batch in batches:
        inputs = {w.shape[1]: torch.randn(batch, w.shape[1], dtype=dtype) for w in weights}
        engine = new_engine(loaded, None, max_num_seqs=batch)
        rng = random.Random(0)
        params = SamplingParams(temperature=0.0, max_tokens=steps + 24, ignore_eos=True)
        for i in range(batch):
            prompt = [rng.randrange(3, config.vocab_size) for _ in range(prompt_len)]
            engine.add_request(f"r{i}", prompt, params)
        started: set[str] = set()
        while len(started) < batch:
            started.update(o.request_id for o in engine.step() if o.new_tokens)
        for _ in range(3):  # warm: the first steps at this batch pay first-call costs
            engine.step()
        ceiling: list[float] = []
        step: list[float] = []
        with torch.inference_mode():
            for _ in range(steps):
                start = time.perf_counter()
                for w in weights:
                    F.linear(inputs[w.shape[1]], w)
                ceiling.append(time.perf_counter() - start)
                start = time.perf_counter()
                outs = engine.step()
                step.append(time.perf_counter() - start)
                assert len(outs) == batch, f"a step decoded {len(outs)} of {batch}"
        c, s = statistics.median(ceiling), statistics.median(step)
        out[str(batch)] = {
            "ceiling_ms": 1e3 * c,
            "step_ms": 1e3 * s,
            "pct_of_ceiling": 100 * c / s,
            "pct_of_mins": 100 * min(ceiling) / min(step),
            "ceiling_s": ceiling,
            "step_s": step,
        }
    return out


def run_arm(tree: Path, args: argparse.Namespace) -> dict[str, Any]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(str(tree / r) for r in SOURCE_ROOTS)
    if args.threads:
        env["OMP_NUM_THREADS"] = str(args.threads)
    cmd = [
        sys.executable,
        str(Path(__file__).resolve()),
        "--probe",
        "--dtype",
        args.dtype,
        "--batches",
        args.batches,
        "--steps",
        str(args.steps),
        "--prompt-len",
        str(args.prompt_len),
    ]
    if args.threads:
        cmd += ["--threads", str(args.threads)]
    done = subprocess.run(cmd, env=env, capture_output=True, text=True, check=True, cwd="/")
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--old", type=Path, help="a checkout of the old code")
    parser.add_argument(
        "--dtype",
        default="bfloat16",
        choices=("float32", "bfloat16", "q4"),
        help="the model's weights: widened (float32, bfloat16) or the GGUF's 4-bit (q4)",
    )
    parser.add_argument("--batches", default="64,1")
    parser.add_argument("--steps", type=int, default=16, help="timed steps per batch and arm")
    parser.add_argument("--prompt-len", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=4)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: default)")
    parser.add_argument("--probe", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    batches = [int(b) for b in args.batches.split(",")]
    if args.probe:
        if args.threads:
            import torch

            torch.set_num_threads(args.threads)
        print(json.dumps(probe(args.dtype, batches, args.steps, args.prompt_len)))
        return 0
    if args.old is None or not (args.old / "engine_worker").is_dir():
        parser.error("--old takes a checkout (a folder with engine_worker/)")
    arms = (("old", args.old.resolve()), ("new", ROOT))
    rounds: list[dict[str, Any]] = []
    for r in range(args.rounds):
        results: dict[str, Any] = {}
        for name, tree in arms if r % 2 == 0 else arms[::-1]:
            results[name] = run_arm(tree, args)
            print(
                f"[{time.strftime('%H:%M:%S')}] round {r + 1} {name}: "
                + ", ".join(
                    f"b{b} {results[name][str(b)]['step_ms']:.1f} ms "
                    f"({results[name][str(b)]['pct_of_ceiling']:.1f} % of ceiling)"
                    for b in batches
                ),
                flush=True,
            )
        rounds.append(results)
    summary: dict[str, Any] = {}
    print("\n| batch | old % of ceiling | new % of ceiling | new / old step (per round) |")
    print("|---|---|---|---|")
    for b in batches:
        key = str(b)
        pct = {n: [rd[n][key]["pct_of_ceiling"] for rd in rounds] for n, _ in arms}
        # new / old in time, each side normalised by its own process's ceiling
        speed = [
            rd["old"][key]["pct_of_ceiling"] / rd["new"][key]["pct_of_ceiling"] for rd in rounds
        ]
        summary[key] = {
            "old_pct_median": statistics.median(pct["old"]),
            "new_pct_median": statistics.median(pct["new"]),
            "new_over_old_time_per_round": speed,
            "new_over_old_time_median": statistics.median(speed),
        }
        print(
            f"| {b} | {statistics.median(pct['old']):.1f} ({min(pct['old']):.1f}-"
            f"{max(pct['old']):.1f}) | {statistics.median(pct['new']):.1f} "
            f"({min(pct['new']):.1f}-{max(pct['new']):.1f}) | "
            f"{statistics.median(speed):.3f} ({', '.join(f'{x:.2f}' for x in speed)}) |"
        )
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        report = {
            "started": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
            "args": {k: str(v) for k, v in vars(args).items()},
            "summary": summary,
            "rounds": rounds,
        }
        args.json.write_text(json.dumps(report, indent=1) + "\n")
        print(f"\nwrote {args.json}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
