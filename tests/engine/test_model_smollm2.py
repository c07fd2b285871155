"""The default model, SmolLM2-135M-Instruct from its Q4_1 GGUF, against transformers.

The reference is transformers loading the same GGUF file itself (``gguf_file=``): its own
dequantization and its own Q/K un-permutation, independent of ours, so a wrong
permutation fails here. (Comparing against transformers fed *our* dequantized weights
would agree even with wrong weights.) A wrong permutation can still answer a short prompt
correctly, so the greedy check runs 32 tokens.

Tolerances, with logits up to ~37 in magnitude: float32 1e-3 (measured 4e-5 to 6e-5 in
one pass, up to 1e-4 in chunks). bf16 against transformers' bf16: 1.5, six bf16 steps at
that magnitude (measured 0.56 to 0.84); against float32 truth our bf16 errs no more than
1.5 times transformers' bf16 (measured: equal, 1.2 both), and picks the same next token.
"""

from __future__ import annotations

import copy
import itertools
from pathlib import Path

import pytest
import torch
from testkit.paged_steps import PagedSteps
from transformers import (
    AutoModelForCausalLM,
    AutoTokenizer,
    PreTrainedModel,
    PreTrainedTokenizerBase,
)

from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.default_model import default_model_path
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.loader import load_model

pytestmark = pytest.mark.slow

F32_ATOL = 1e-3
BF16_ATOL = 1.5
NEW_TOKENS = 32
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PROMPTS = [
    "The capital of France is",
    CHAT.format("Write a short poem about the sea."),
    CHAT.format("Explain in two sentences why the sky is blue by day and red at sunset."),
]


@pytest.fixture(scope="module")
def gguf_path() -> Path:
    return default_model_path()


@pytest.fixture(scope="module")
def ours() -> tuple[LlamaForCausalLM, ModelConfig]:
    # The float path (widened, through the user's dequantization cache): what transformers
    # computes. The quantized default is held to it in test_quant_model.py.
    return load_model(None, quantization="none")


@pytest.fixture(scope="module")
def reference(gguf_path: Path) -> PreTrainedModel:
    model: PreTrainedModel = AutoModelForCausalLM.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name, dtype=torch.float32
    )
    return model.eval()


@pytest.fixture(scope="module")
def tokenizer(gguf_path: Path) -> PreTrainedTokenizerBase:
    loaded: PreTrainedTokenizerBase = AutoTokenizer.from_pretrained(
        gguf_path.parent, gguf_file=gguf_path.name
    )
    return loaded


@pytest.fixture(scope="module")
def prompts(tokenizer: PreTrainedTokenizerBase) -> list[list[int]]:
    return [tokenizer(p, add_special_tokens=False).input_ids for p in PROMPTS]


def reference_logits(reference: PreTrainedModel, tokens: list[int]) -> torch.Tensor:
    with torch.inference_mode():
        logits: torch.Tensor = reference(torch.tensor([tokens])).logits[0].float()
    return logits


def test_config_read_from_the_gguf(ours: tuple[LlamaForCausalLM, ModelConfig]) -> None:
    _, config = ours
    assert config.name == "SmolLM2-135M-Instruct.Q4_1"
    assert config.architecture == "LlamaForCausalLM"
    shape = (config.num_hidden_layers, config.hidden_size, config.intermediate_size)
    assert shape == (30, 576, 1536)
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert heads == (9, 3, 64)
    assert (config.vocab_size, config.max_position_embeddings) == (49152, 8192)
    assert (config.rope_theta, config.rope_scaling, config.tie_word_embeddings) == (
        100000.0,
        None,
        True,
    )
    assert (config.bos_token_id, config.eos_token_ids) == (1, (2,))


def test_prompt_logits_match_transformers_whole_and_in_chunks(
    ours: tuple[LlamaForCausalLM, ModelConfig],
    reference: PreTrainedModel,
    prompts: list[list[int]],
) -> None:
    model, config = ours
    tokens = prompts[2]
    assert len(tokens) == 25
    want = reference_logits(reference, tokens)

    whole = PagedSteps(model, config, block_size=16).step({"p": tokens})["p"]
    torch.testing.assert_close(whole, want, atol=F32_ATOL, rtol=0)

    steps = PagedSteps(model, config, block_size=16, seed=1)
    cuts = [0, 10, 11, 24, 25]  # a chunk, one token, a chunk across a block edge, the rest
    chunked = [steps.step({"p": tokens[a:b]})["p"] for a, b in itertools.pairwise(cuts)]
    torch.testing.assert_close(torch.cat(chunked), want, atol=F32_ATOL, rtol=0)


def test_batched_greedy_decode_is_token_identical_to_generate(
    ours: tuple[LlamaForCausalLM, ModelConfig],
    reference: PreTrainedModel,
    prompts: list[list[int]],
    tokenizer: PreTrainedTokenizerBase,
) -> None:
    """All prompts decode together, one forward per token, through one paged cache."""
    model, config = ours
    steps = PagedSteps(model, config, num_blocks=64, block_size=16)
    batch = prompts[:2]  # the first ends early (end of turn) while the other runs on
    logits = steps.step(dict(enumerate(batch)))
    generated: dict[int, list[int]] = {i: [] for i in range(len(batch))}
    while logits:
        for i, rows in logits.items():
            generated[i].append(int(rows[-1].argmax()))
        running = {
            i: [out[-1]]
            for i, out in generated.items()
            if out[-1] not in config.eos_token_ids and len(out) < NEW_TOKENS
        }
        logits = steps.step(running) if running else {}

    for i, tokens in enumerate(batch):
        with torch.inference_mode():
            out = reference.generate(
                torch.tensor([tokens]),
                attention_mask=torch.ones(1, len(tokens), dtype=torch.int64),
                max_new_tokens=NEW_TOKENS,
                do_sample=False,
                pad_token_id=config.eos_token_ids[0],
            )
        assert generated[i] == out[0, len(tokens) :].tolist(), PROMPTS[i]
    assert [len(g) for g in generated.values()] == [30, NEW_TOKENS]  # 30: it ended its turn
    assert generated[0][-1] in config.eos_token_ids
    assert str(tokenizer.decode(generated[0])).startswith(" Paris")


def test_bf16_logits_match_transformers_bf16(
    reference: PreTrainedModel, prompts: list[list[int]]
) -> None:
    model, config = load_model(None, dtype=torch.bfloat16, quantization="none")
    tokens = prompts[1]
    got = PagedSteps(model, config, block_size=16).step({"p": tokens})["p"]
    want = reference_logits(copy.deepcopy(reference).to(torch.bfloat16), tokens)
    torch.testing.assert_close(got, want, atol=BF16_ATOL, rtol=0)
    assert got[-1].argmax() == want[-1].argmax()
    truth = reference_logits(reference, tokens)
    assert (got - truth).abs().max() <= 1.5 * (want - truth).abs().max()
