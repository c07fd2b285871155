"""bench/engine_throughput.py's kvflow-warm arm: one engine for every run, primed once, its
prefix cache emptied before each run, so no run is served another's prompts (the timed
workload is the same in every run). Never speed: a benchmark is not a test."""

from __future__ import annotations

from pathlib import Path

from testkit.tiny_model import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

import kvflow_arms as bench  # noqa: E402
from throughput_stats import WorkloadSpec, make_workload  # noqa: E402

from kvflow.engine_worker.core.engine import Engine  # noqa: E402
from kvflow.engine_worker.model.loader import load_model  # noqa: E402


def test_the_warm_engine_is_primed_once_and_serves_no_run_from_another(tmp_path: Path) -> None:
    path = str(write_tiny_llama(tmp_path / "tiny", seed=0))
    loaded = load_model(path)
    vocab = loaded[1].vocab_size
    spec = WorkloadSpec(6, (20, 40), (4, 8))
    engines: list[Engine] = []

    def make() -> Engine:
        engines.append(bench.new_engine(path, loaded, max_num_seqs=4, kv_cache_gib=0.05))
        return engines[-1]

    warm = bench.WarmEngine(make, make_workload(spec, vocab, seed=2))
    w = make_workload(spec, vocab, seed=0)
    for _ in range(3):
        _, produced = warm.run(w)
        assert produced == w.num_output_tokens
    assert len(engines) == 1
    stats = engines[0].kv_cache.stats
    # Three runs of the same prompts: every prompt token was looked up, and none was a hit
    # (random prompts share no block; a run repeating the last one's would).
    assert stats.num_queried_tokens >= 3 * sum(len(p) for p in w.prompts)
    assert stats.num_hit_tokens == 0
