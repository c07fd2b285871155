"""What a grammar mask costs per decode step, in the real sampler, on this machine.

Arms, same random logits (SmolLM2's 49,152-token vocabulary), same batch, one step at a
time as the engine runs it:
  plain       Sampler.sample with no constraint (the baseline)
  json        every row under a JSON schema (nested object, enum, array, bounded strings)
  json_half   half the rows constrained, half free (a mixed batch)
Each constrained row's processor advances over the token the previous step sampled, so the
masks are those of real, growing outputs (a finished row restarts on a fresh matcher).
Reported: the sampler step's median and P90 wall time, the added cost per step and per
constrained row, and the processor's own time (advance + bitmask + unpack) per row.

    python bench/structured_mask.py [--quick] [--batch 1,8,32] [--steps N] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from testkit.structured_schemas import SCHEMAS  # noqa: E402
from testkit.tokenizer_files import SMOLLM2_VOCAB_SIZE, write_smollm2_tokenizer  # noqa: E402

from kvflow.engine_worker.core.sampling_params import SamplingParams  # noqa: E402
from kvflow.engine_worker.sampler import Sampler  # noqa: E402
from kvflow.engine_worker.structured.grammar import GrammarCompiler, GrammarSpec  # noqa: E402
from kvflow.engine_worker.structured.processor import GrammarLogitsProcessor  # noqa: E402
from kvflow.engine_worker.structured.vocabulary import load_vocabulary  # noqa: E402

EOS = 2


@dataclass
class Row:
    prompt_token_ids: list[int]
    token_ids: list[int]


class Timed:
    """Wraps a processor to time its calls."""

    def __init__(self, inner: GrammarLogitsProcessor, sink: list[float]) -> None:
        self.inner, self.sink = inner, sink

    def allowed_token_mask(self, output_token_ids: Any) -> torch.Tensor | None:
        started = time.perf_counter()
        mask = self.inner.allowed_token_mask(output_token_ids)
        self.sink.append(time.perf_counter() - started)
        return mask


def run_arm(
    compiler: GrammarCompiler, spec: GrammarSpec, batch: int, num_constrained: int, steps: int
) -> dict[str, float]:
    sampler = Sampler("cpu")
    generator = torch.Generator().manual_seed(0)
    processor_s: list[float] = []
    base = SamplingParams(temperature=1.0, seed=1)

    def fresh(i: int) -> tuple[Row, SamplingParams]:
        if i >= num_constrained:
            return Row([1], [1]), base
        timed = Timed(GrammarLogitsProcessor.compile(compiler, spec), processor_s)
        return Row([1], [1]), replace(base, logits_processor=timed)  # type: ignore[arg-type]

    rows = [fresh(i) for i in range(batch)]
    step_s: list[float] = []
    for _step in range(steps):
        logits = torch.randn(batch, SMOLLM2_VOCAB_SIZE, generator=generator)
        ids = [f"r{i}" for i in range(batch)]
        started = time.perf_counter()
        out = sampler.sample(logits, ids, [p for _, p in rows],
                             histories=[r for r, _ in rows])  # fmt: skip
        step_s.append(time.perf_counter() - started)
        for i, token in enumerate(out):
            row, _ = rows[i]
            if token.token_id == EOS or len(row.token_ids) > 200:
                rows[i] = fresh(i)
            else:
                row.token_ids.append(token.token_id)
    warm = step_s[len(step_s) // 10 :]
    ordered = sorted(warm)
    return {
        "step_ms_p50": 1e3 * statistics.median(warm),
        "step_ms_p90": 1e3 * ordered[int(0.9 * (len(ordered) - 1))],
        "processor_us_p50": 1e6 * statistics.median(processor_s) if processor_s else 0.0,
        "processor_us_p90": (
            1e6 * sorted(processor_s)[int(0.9 * (len(processor_s) - 1))] if processor_s else 0.0
        ),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="200 steps per arm")
    parser.add_argument("--batch", default="1,8,32")
    parser.add_argument("--steps", type=int, default=1000)
    parser.add_argument("--json", type=Path)
    args = parser.parse_args()
    steps = 200 if args.quick else args.steps
    torch.set_num_threads(1)  # the worker's sampler on one core: what a CPU worker pays
    folder = write_smollm2_tokenizer(Path("/tmp/kvflow-bench-structured"))
    started = time.perf_counter()
    compiler = GrammarCompiler(load_vocabulary(folder, (EOS,)), SMOLLM2_VOCAB_SIZE)
    setup_s = time.perf_counter() - started
    spec = GrammarSpec("json_schema", json.dumps(SCHEMAS["nested_enum_array"]))
    started = time.perf_counter()
    compiler.matcher(spec)
    compile_ms = 1e3 * (time.perf_counter() - started)
    started = time.perf_counter()
    compiler.matcher(spec)
    cached_ms = 1e3 * (time.perf_counter() - started)
    print(f"vocabulary + tokenizer {setup_s:.2f} s; compile {compile_ms:.2f} ms; "
          f"cached copy {cached_ms:.3f} ms")  # fmt: skip
    results: list[dict[str, Any]] = []
    print(f"{'batch':>5} {'arm':>9} {'step p50 ms':>11} {'p90 ms':>7} {'+ms/step':>8} "
          f"{'+us/row':>8} {'proc p50 us':>11} {'p90 us':>7}")  # fmt: skip
    for batch in [int(b) for b in args.batch.split(",")]:
        plain = run_arm(compiler, spec, batch, 0, steps)
        for arm, constrained in (("plain", 0), ("json_half", batch // 2), ("json", batch)):
            if arm == "json_half" and constrained == 0:
                continue
            r = plain if arm == "plain" else run_arm(compiler, spec, batch, constrained, steps)
            added_ms = r["step_ms_p50"] - plain["step_ms_p50"]
            per_row_us = 1e3 * added_ms / constrained if constrained else 0.0
            results.append({"batch": batch, "arm": arm, "constrained_rows": constrained,
                            "added_ms_per_step": added_ms, "added_us_per_row": per_row_us,
                            **r})  # fmt: skip
            print(f"{batch:>5} {arm:>9} {r['step_ms_p50']:>11.3f} {r['step_ms_p90']:>7.3f} "
                  f"{added_ms:>8.3f} {per_row_us:>8.1f} {r['processor_us_p50']:>11.1f} "
                  f"{r['processor_us_p90']:>7.1f}")  # fmt: skip
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        meta = {"python": platform.python_version(), "torch": torch.__version__,
                "steps": steps, "compile_ms": compile_ms, "cached_copy_ms": cached_ms,
                "vocab_setup_s": setup_s}  # fmt: skip
        args.json.write_text(json.dumps({"meta": meta, "results": results}, indent=2) + "\n")


if __name__ == "__main__":
    main()
