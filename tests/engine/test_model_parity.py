"""Our decoder's logits equal transformers' on the same random weights, whole or paged.

Each case writes a tiny random model (``testkit.tiny_model``), loads it with our loader and
with transformers' ``AutoModelForCausalLM`` (which picks ``LlamaForCausalLM``,
``MistralForCausalLM`` or ``Qwen2ForCausalLM`` from the config), and compares logits of a
48-token prompt. The random weights give logits with a standard deviation of about 1, so
the float32 tolerance of 1e-4 is about 1e-4 relative (measured: under 1e-5).

bf16: both sides run in bf16 and round differently (fused QKV, a different attention
kernel); the tolerance 0.2 is about 6 bf16 steps at the logits' magnitude (up to ~5;
measured: at most 0.10). Against float32 truth, our bf16 may err at most 1.5 times as much
as transformers' bf16 (measured: 0.10-0.18 vs 0.10-0.22), and a greedy token that bf16
picks differently must be a near-tie: within 0.15 of the best logit (measured: 0.055).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.paged_steps import PagedSteps
from testkit.tiny_model import write_tiny_llama
from transformers import AutoModelForCausalLM

from kvflow.engine_worker.model.loader import load_model

F32_ATOL = 1e-4
BF16_ATOL = 0.2
BF16_GREEDY_REGRET = 0.15
PROMPT_LEN = 48

CASES: dict[str, dict[str, Any]] = {
    "llama-gqa-untied": {},
    "llama-mha-tied": {"num_key_value_heads": 4, "tie_word_embeddings": True},
    "llama3-rope-scaling": {
        "rope_theta": 500000.0,
        "rope_scaling": {
            "rope_type": "llama3",
            "factor": 8.0,
            "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            # Small, so that the 8 frequencies of a 16-wide head fall in all three bands.
            "original_max_position_embeddings": 64,
        },
    },
    "linear-rope-wide-heads": {
        "head_dim": 32,  # wider than hidden_size / heads = 16
        "rope_scaling": {"type": "linear", "factor": 4.0},  # transformers 4 spelling
        "num_key_value_heads": 1,
    },
    "llama-attention-and-mlp-bias": {"attention_bias": True, "mlp_bias": True},
    "mistral": {
        "architectures": ["MistralForCausalLM"],
        "model_type": "mistral",
        "sliding_window": None,
    },
    "qwen2-qkv-bias-tied": {
        "architectures": ["Qwen2ForCausalLM"],
        "model_type": "qwen2",
        "tie_word_embeddings": True,
        "rope_theta": 1000000.0,
    },
}


def prompt(seed: int, length: int = PROMPT_LEN) -> list[int]:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(0, 49152, (length,), generator=generator).tolist()


@pytest.fixture(scope="module", params=sorted(CASES))
def tiny(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp(request.param) / request.param
    return write_tiny_llama(folder, seed=7, num_hidden_layers=3, **CASES[request.param])


def reference_logits(folder: Path, tokens: list[int], dtype: torch.dtype) -> torch.Tensor:
    reference = AutoModelForCausalLM.from_pretrained(folder, dtype=dtype)
    with torch.inference_mode():
        logits: torch.Tensor = reference(torch.tensor([tokens])).logits[0].float()
    return logits


def test_whole_prompt_in_one_forward_matches_transformers(tiny: Path) -> None:
    tokens = prompt(1)
    model, config = load_model(tiny)
    got = PagedSteps(model, config).step({"a": tokens})["a"]
    want = reference_logits(tiny, tokens, torch.float32)
    assert got.shape == want.shape == (PROMPT_LEN, config.vocab_size)
    torch.testing.assert_close(got, want, atol=F32_ATOL, rtol=0)


def test_chunked_prefill_and_batched_decode_through_the_paged_cache(tiny: Path) -> None:
    """Two sequences share each step: prefill chunks of uneven sizes, then decodes."""
    a, b = prompt(2), prompt(3, length=30)
    plans = {"a": [16, 7, 1, 20, 1, 1, 1, 1], "b": [5, 12, 9, 1, 1, 1, 1]}
    model, config = load_model(tiny)
    steps = PagedSteps(model, config, block_size=4)
    got: dict[str, list[torch.Tensor]] = {"a": [], "b": []}
    done = {"a": 0, "b": 0}
    tokens = {"a": a, "b": b}
    for i in range(max(len(p) for p in plans.values())):
        chunks = {}
        for seq, plan in plans.items():
            if i < len(plan):
                chunks[seq] = tokens[seq][done[seq] : done[seq] + plan[i]]
                done[seq] += plan[i]
        for seq, logits in steps.step(chunks).items():
            got[seq].append(logits)
    assert done == {"a": len(a), "b": len(b)}
    for seq in ("a", "b"):
        want = reference_logits(tiny, tokens[seq], torch.float32)
        torch.testing.assert_close(torch.cat(got[seq]), want, atol=F32_ATOL, rtol=0)


def test_bf16_logits_match_transformers_bf16(tiny: Path) -> None:
    tokens = prompt(4)
    model, config = load_model(tiny, dtype=torch.bfloat16)
    assert model.rotary.cos.dtype == torch.float32  # angles stay exact in a bf16 model
    got = PagedSteps(model, config).step({"a": tokens})["a"]
    assert got.dtype == torch.float32
    want_bf16 = reference_logits(tiny, tokens, torch.bfloat16)
    torch.testing.assert_close(got, want_bf16, atol=BF16_ATOL, rtol=0)

    # Against the float32 truth, our bf16 errs no more than transformers' bf16 does...
    truth = reference_logits(tiny, tokens, torch.float32)
    our_error = (got - truth).abs().max().item()
    their_error = (want_bf16 - truth).abs().max().item()
    assert our_error <= 1.5 * their_error
    # ...and where bf16 rounding flips the greedy token, it flips to a near-tie.
    best = truth.max(dim=-1).values
    picked = truth.gather(1, got.argmax(dim=-1, keepdim=True))[:, 0]
    assert (best - picked).max().item() <= BF16_GREEDY_REGRET
