"""bench/perplexity.py's scoring through the engine's paged path: the same text scored in
512-token chunks (prefill) and one token per step (decode, every token read back from the
cache) gives the same log-likelihoods on a float cache, and a quantized cache moves them by
a little, not by nothing. Never speed: a benchmark is not a test."""

from __future__ import annotations

from pathlib import Path

import torch
from testkit.tiny_model import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

import perplexity as bench  # noqa: E402

from kvflow.engine_worker.model.loader import load_model  # noqa: E402


def test_chunked_and_token_by_token_scoring_agree(tmp_path: Path) -> None:
    path = write_tiny_llama(tmp_path / "tiny", seed=2)
    loaded = load_model(str(path))
    tokens = [(i * 131) % 49000 + 3 for i in range(150)]  # 10 blocks, the last partial
    nll, choices, memory = bench.score(loaded, "auto", tokens, chunk=64)
    assert nll.shape == choices.shape == (149,)
    assert memory.num_blocks == 10
    one_by_one, same_choices, _ = bench.score(loaded, "auto", tokens, chunk=1)
    torch.testing.assert_close(one_by_one, nll, rtol=0, atol=1e-4)
    assert torch.equal(same_choices, choices)
    int8, _, quantized = bench.score(loaded, "int8", tokens, chunk=64)
    assert quantized.kv_cache_dtype == "int8+float16scales"
    assert 0 < (int8 - nll).abs().max() < 0.1
    assert (bench.TEXT).read_text().startswith("Execution model\n")
