"""The model split over tensor-parallel ranks computes what the whole model computes.

Ranks run as threads over real gloo collectives (``testkit.tp_threads``), each with its own
slice of the weights. Against the unsplit model on the same tokens: logits within float32
rounding (the sums across ranks add partial products in another order: about 1e-6 of
logits of unit scale; 1e-4 allowed, the tolerance of test_model_parity) and greedy tokens
identical, on a plain and a grouped-query model. Quantized weights multiply in bf16, and a
split rounds each rank's partial product where the whole model rounds the sum: there the
bound is what the quantized model itself errs by against float32 (test_quant_model.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import gguf
import pytest
import torch
from testkit.paged_steps import PagedSteps
from testkit.tiny_gguf import write_tiny_gguf
from testkit.tiny_model import write_tiny_llama
from testkit.tp_threads import on_ranks

from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.model.shard import tensor_parallel_problem
from kvflow.engine_worker.model.tensor_parallel import GroupRanks

ATOL = 1e-4
PROMPT = torch.randint(0, 512, (40,), generator=torch.Generator().manual_seed(1)).tolist()


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))


def greedy(path: Path, steps: int = 12) -> tuple[torch.Tensor, list[int]]:
    """The whole model's prompt logits and ``steps`` greedy tokens."""
    model, config = load_model(path)
    paged = PagedSteps(model, config, num_blocks=64, block_size=16)
    first = paged.step({"a": PROMPT})["a"]
    tokens = [int(first[-1].argmax())]
    for _ in range(steps - 1):
        tokens.append(int(paged.step({"a": [tokens[-1]]})["a"][-1].argmax()))
    return first, tokens


def split(path: Path, size: int) -> tuple[torch.Tensor, list[int]]:
    """The split model's prompt logits and greedy tokens: rank 0 picks each token and the
    other ranks learn it through the group, as the worker's plans tell them."""

    def run(ranks: GroupRanks) -> tuple[Any, list[int]]:
        model, config = load_model(path, tp=ranks)
        paged = PagedSteps(model, config, num_blocks=64, block_size=16)
        out = paged.step({"a": PROMPT})
        first = out.get("a")
        tokens: list[int] = []
        pick = torch.zeros(1, dtype=torch.float32)
        if first is not None:
            pick[0] = float(first[-1].argmax())
        for _ in range(12):
            ranks.all_reduce(pick)  # rank 0's pick; the others add 0
            tokens.append(int(pick[0]))
            out = paged.step({"a": [tokens[-1]]})
            pick.zero_()
            if "a" in out:
                pick[0] = float(out["a"][-1].argmax())
        return first, tokens

    results = on_ranks(size, run)
    first, tokens = results[0]
    assert all(r[0] is None for r in results[1:]), "only rank 0 gets logits"
    assert all(r[1] == tokens for r in results), "every rank ran the same tokens"
    return first, tokens


@pytest.mark.parametrize(
    ("options", "kind"),
    [
        ({"num_key_value_heads": 4}, None),
        ({"num_key_value_heads": 2}, None),  # grouped-query: 2 query heads per KV head
        ({"num_key_value_heads": 2, "tie_word_embeddings": True, "attention_bias": True}, None),
        ({"num_key_value_heads": 2}, gguf.GGMLQuantizationType.Q8_0),
        ({"num_key_value_heads": 2, "tie_word_embeddings": True}, gguf.GGMLQuantizationType.Q4_0),
    ],
    ids=["mha", "gqa", "gqa-tied-bias", "gqa-q8_0", "gqa-tied-q4_0"],
)
def test_two_ranks_compute_what_one_does(
    tmp_path: Path, options: dict[str, Any], kind: gguf.GGMLQuantizationType | None
) -> None:
    folder = write_tiny_llama(tmp_path / "tiny", vocab_size=512, seed=3, **options)
    path = (
        folder if kind is None else write_tiny_gguf(folder, tmp_path / "t.gguf", matrix_type=kind)
    )
    whole_logits, whole_tokens = greedy(path)
    split_logits, split_tokens = split(path, 2)
    tolerance = ATOL
    if kind is not None:
        model, config = load_model(path, quantization="none")
        float_logits = PagedSteps(model, config, num_blocks=64, block_size=16).step({"a": PROMPT})
        tolerance = 2 * float((whole_logits - float_logits["a"]).abs().max())
    torch.testing.assert_close(split_logits, whole_logits, atol=tolerance, rtol=0)
    if kind is None:
        assert split_tokens == whole_tokens
    elif split_tokens != whole_tokens:  # rounded elsewhere, a near-tie may go either way
        pairs = zip(split_tokens, whole_tokens, strict=True)
        at = next(i for i, (a, b) in enumerate(pairs) if a != b)
        model, config = load_model(path)
        steps = PagedSteps(model, config, num_blocks=64, block_size=16)
        logits = steps.step({"a": PROMPT + whole_tokens[:at]})["a"][-1]
        top2 = logits.topk(2).values
        assert top2[0] - top2[1] <= tolerance, f"token {at} differs off a near-tie"


def test_a_model_whose_heads_do_not_divide_is_refused_with_the_sizes_that_do(
    tmp_path: Path,
) -> None:
    # SmolLM2-135M's shape in little: 9 query heads, 3 KV heads.
    folder = write_tiny_llama(
        tmp_path / "tiny", vocab_size=513 * 0 + 576, hidden_size=72, num_attention_heads=9,
        num_key_value_heads=3, intermediate_size=96,
    )  # fmt: skip
    with pytest.raises(ModelLoadError, match="9 attention heads do not divide among 2 ranks"):
        on_ranks(2, lambda ranks: load_model(folder, tp=ranks))
    _, config = load_model(folder)
    assert tensor_parallel_problem(config, 3) is None
    assert "splits over 1, 3" in str(tensor_parallel_problem(config, 2))
