"""bench/engine_throughput.py's ``--dtype``: an engine is built in the dtype of the weights
it is given, so a bf16 arm is bf16 end to end (weights, cache) and the kvflow-fp32 arm is
float32. Never speed: a benchmark is not a test."""

from __future__ import annotations

from pathlib import Path

import torch
from testkit.tiny_model import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

import kvflow_arms as bench  # noqa: E402
from throughput_stats import WorkloadSpec, make_workload  # noqa: E402

from kvflow.engine_worker.model.loader import load_model  # noqa: E402


def test_an_engine_runs_in_the_dtype_of_its_weights(tmp_path: Path) -> None:
    path = str(write_tiny_llama(tmp_path / "tiny", seed=0))
    for dtype in (torch.bfloat16, torch.float32):
        loaded = load_model(path, dtype=dtype)
        engine = bench.new_engine(path, loaded, max_num_seqs=4, kv_cache_gib=0.05)
        runner = engine.runner
        assert {c.dtype for c in runner.kv_caches} == {dtype}  # type: ignore[attr-defined]
        w = make_workload(WorkloadSpec(4, (8, 16), (3, 5)), loaded[1].vocab_size, seed=0)
        _, produced = bench.run_kvflow(engine, w)
        assert produced == w.num_output_tokens
