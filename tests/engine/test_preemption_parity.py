"""Preemption, recompute and eviction over the real paged KV cache keep greedy outputs exact.

The engine runs in-process with the real torch runner and so few KV blocks that its
requests do not fit together: the scheduler preempts, the preempted requests recompute
their prompt *and the tokens they had generated* (partly from their own cached blocks),
later requests evict cached blocks, and later still requests hit blocks that were evicted
and stored again. Every output must still be token-identical to transformers' greedy
`generate` on the same weights. Each of those events is asserted from the engine's own
state (request counters, the KV event stream, what the runner was asked to compute), so
a workload change that stops exercising one of them fails instead of passing vacuously.

The pure engine tests do the same bookkeeping with a fake runner that never reads the
KV cache; here a block served from cache with the wrong contents changes the tokens.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import pytest
import torch
from testkit.engine_trace import Arrival, Trace, run_waves
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.core.engine import Engine
from kvflow.engine_worker.core.kv_events import KvEventKind
from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.default_model import default_model_path
from kvflow.engine_worker.model.gguf_cache import read_gguf_cached
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.settings import WorkerSettings
from kvflow.proto.block_hash import BlockHash

transformers = pytest.importorskip("transformers", reason="transformers is a dev dependency")


@pytest.fixture(autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Run these small batches on one thread, and put the caller's setting back.

    A second thread buys little at batch 3 and costs a lot on a busy CPU: on 2 cores at
    load 6, the tiny model's engine run and `generate` took 0.3 s + 0.9 s on one thread
    and 7 s + 27 s on two; SmolLM2's engine run 6.6 CPU-s against 24.
    """
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def hf_greedy(model: Any, prompt: list[int], max_tokens: int) -> list[int]:
    """transformers' greedy tokens, ending in the EOS token if it stopped on one."""
    ids = torch.tensor([prompt])
    with torch.inference_mode():
        out = model.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=max_tokens,
            do_sample=False,
            pad_token_id=0,
        )
    tokens: list[int] = out[0, len(prompt) :].tolist()
    return tokens


def check_against_transformers(trace: Trace, hf: Any, arrivals: Sequence[Arrival]) -> None:
    expected: dict[tuple[tuple[int, ...], int], list[int]] = {}
    for a in arrivals:
        key = (tuple(a.prompt), a.max_tokens)
        if key not in expected:
            expected[key] = hf_greedy(hf, a.prompt, a.max_tokens)
        assert trace.outputs[a.request_id] == expected[key], a.request_id


def check_what_happened(trace: Trace, engine: Engine, arrivals: Sequence[Arrival]) -> None:
    """Preemption with recompute, eviction and reuse of re-cached blocks all took place."""
    # Preempted after generating: the recompute covers output tokens, not only the prompt.
    assert any(n > 0 for _, _, n in trace.preemptions), trace.preemptions
    assert {rid for _, rid, _ in trace.preemptions} == {
        rid for rid, r in trace.requests.items() if r.num_preemptions > 0
    }
    # Some preempted request came back on its own blocks that survived in the cache.
    preempted = {rid for _, rid, _ in trace.preemptions}
    assert any(
        rid in preempted and step > min(p for p, r, _ in trace.preemptions if r == rid)
        for step, rid, _ in trace.hits()
    )
    # Cached blocks were evicted...
    removed = {h for _, kind, h in trace.events if kind is KvEventKind.REMOVED}
    assert removed
    # ...and later requests were served from the cache, some from blocks stored again
    # after their eviction.
    first_wave = min(a.wave for a in arrivals)
    later = [a.request_id for a in arrivals if a.wave > first_wave]
    assert any(trace.requests[rid].num_cached_tokens > 0 for rid in later)
    assert trace.hits_on_recached_blocks()
    # The event stream replays to exactly the pool's cache (what a router's index holds),
    # and every block is free again.
    replayed: set[BlockHash] = set()
    for _, kind, h in trace.events:
        assert (h in replayed) == (kind is KvEventKind.REMOVED), (kind, h)
        if kind is KvEventKind.STORED:
            replayed.add(h)
        else:
            replayed.discard(h)
    assert replayed == set(engine.kv_cache.pool.cached_hashes())
    assert engine.kv_cache.pool.num_free_blocks == engine.kv_cache.num_total_blocks
    assert not engine.has_unfinished_requests


def small_engine(model: str | None, loaded: Any, **overrides: Any) -> Engine:
    return build_worker(WorkerSettings(model=model, **overrides), loaded=loaded).engine


def run_and_check(
    model: str | None, loaded: Any, hf: Any, arrivals: list[Arrival], **settings: Any
) -> None:
    engine = small_engine(model, loaded, **settings)
    trace = run_waves(engine, arrivals)
    runner = getattr(engine.runner, "inner", engine.runner)  # under run_waves' recorder
    workspace = getattr(runner, "workspace", None)
    # The path under test is the one that ran: the paged kernel, or not; the workspace held
    # slots, or there is none; the padded decode steps of model/decode_graphs.py ran, or
    # there are none.
    paged = settings.get("paged_attention", True)
    assert runner.paged_kernel == paged
    workspace_on = settings.get("decode_workspace_gib") is None and not settings.get("cuda_graphs")
    assert (workspace is not None and workspace.num_bytes > 0) == (not paged and workspace_on)
    assert (runner.graphs is not None and runner.graphs.steps > 0) == bool(
        settings.get("cuda_graphs")
    )
    check_against_transformers(trace, hf, arrivals)
    check_what_happened(trace, engine, arrivals)


# -- the tiny random Llama ------------------------------------------------------------------

TINY_BLOCK_SIZE = 4
# 18 blocks of 4 = 72 slots. Wave 0's four prompts (16-22 tokens, 3 full blocks shared)
# grow to 32-38 tokens: 8 + 9 + 9 + 10 - 3 x 3 = 27 blocks, so it preempts. Wave 1's three
# (17-19 tokens, 2 blocks shared) grow to 8 + 9 + 9 - 2 x 2 = 22 blocks: it preempts too and
# evicts wave 0's cached blocks. Wave 2 computes the shared prefix again, then hits it.
# (16 to 24 blocks all exercise every path; at 26 nothing is preempted any more.)
TINY_NUM_BLOCKS = 18
# A vocabulary 12x smaller than SmolLM2's: the output head, the tiny model's largest
# matrix, costs no more than its layers.
TINY_VOCAB_SIZE = 4096


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any, Any]:
    path = write_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "model",
        seed=3,
        num_hidden_layers=3,
        vocab_size=TINY_VOCAB_SIZE,
    )
    hf = transformers.LlamaForCausalLM.from_pretrained(path, dtype=torch.float32).eval()
    return str(path), load_model(path, quantization="none"), hf


def tiny_arrivals() -> list[Arrival]:
    gen = torch.Generator().manual_seed(7)

    def rand(n: int) -> list[int]:
        return torch.randint(3, TINY_VOCAB_SIZE, (n,), generator=gen).tolist()

    shared, other = rand(13), rand(9)  # 3 full blocks and a bit; 2 and a bit
    arrivals = [
        Arrival(f"w0-{i}", shared + rand(3 + 2 * i), max_tokens=16, wave=0, delay_steps=i)
        for i in range(4)
    ]
    arrivals += [Arrival(f"w1-{i}", other + rand(8 + i), max_tokens=16, wave=1) for i in range(3)]
    # The first brings back the shared prefix (evicted by wave 1), the later ones hit it.
    arrivals += [
        Arrival(f"w2-{i}", shared + rand(2 + i), max_tokens=12, wave=2, delay_steps=3 * i)
        for i in range(3)
    ]
    arrivals.append(Arrival("w2-repeat", arrivals[0].prompt, max_tokens=16, wave=2, delay_steps=2))
    return arrivals


# Decodes read the paged cache in place by default on CPU (model/cpu_paged.py); without it
# they read the decode workspace (model/decode_workspace.py), and with that at 0 GiB they
# gather; "graphs" is the padded decode steps of model/decode_graphs.py (replayed from
# CUDA graphs on a GPU, run eagerly here). All must survive preemption and recompute.
MODES: dict[str, dict[str, Any]] = {
    "paged": {},
    "workspace": {"paged_attention": False},
    "gather": {"paged_attention": False, "decode_workspace_gib": 0.0},
    "graphs": {"cuda_graphs": True},
}


@pytest.mark.parametrize("mode", list(MODES))
def test_tiny_model_preemption_and_eviction_match_transformers(
    tiny: tuple[str, Any, Any], mode: str
) -> None:
    path, loaded, hf = tiny
    run_and_check(
        path,
        loaded,
        hf,
        tiny_arrivals(),
        block_size=TINY_BLOCK_SIZE,
        num_kv_blocks=TINY_NUM_BLOCKS,
        **MODES[mode],
    )


# -- SmolLM2-135M-Instruct, lighter -----------------------------------------------------------

SMOL_BLOCK_SIZE = 8
# 9 blocks of 8 = 72 slots. Wave 0's three chat turns (28-31 tokens, the system prompt's
# 2 full blocks shared) grow to 42-45 tokens: 3 x 6 - 2 x 2 = 14 blocks, so it preempts.
# Wave 1's two long prompts (32 and 42 tokens, + 8) need 5 + 7 blocks: they evict every
# cached block. Wave 2 computes the system prompt again, then hits it. (6 to 12 blocks all
# exercise every path; at 13 nothing is preempted any more.)
SMOL_NUM_BLOCKS = 9
SYSTEM = "<|im_start|>system\nYou are a helpful assistant who answers briefly.<|im_end|>\n"
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"


def transformers_llama_on(config: ModelConfig, tensors: Mapping[str, torch.Tensor]) -> Any:
    """transformers' own Llama over the same float32 weights as ours.

    The weights come from our dequantization cache, so a loading bug would not show here:
    test_model_smollm2 compares against transformers' own GGUF loader for that. This keeps
    the test to what it checks (the cache and the scheduler) and loads in 3 s where
    ``from_pretrained(gguf_file=...)`` took 24 s (2 busy cores).
    """
    assert config.rope_scaling is None and not config.qkv_bias and not config.mlp_bias
    hf_config = transformers.LlamaConfig(
        vocab_size=config.vocab_size,
        hidden_size=config.hidden_size,
        intermediate_size=config.intermediate_size,
        num_hidden_layers=config.num_hidden_layers,
        num_attention_heads=config.num_attention_heads,
        num_key_value_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        rms_norm_eps=config.rms_norm_eps,
        rope_theta=config.rope_theta,
        max_position_embeddings=config.max_position_embeddings,
        tie_word_embeddings=config.tie_word_embeddings,
        bos_token_id=config.bos_token_id,
        eos_token_id=list(config.eos_token_ids),
    )
    return transformers.LlamaForCausalLM.from_pretrained(
        None, config=hf_config, state_dict=dict(tensors), dtype=torch.float32
    ).eval()


def smol_arrivals(tokenizer: Any) -> list[Arrival]:
    def ids(text: str) -> list[int]:
        return list(tokenizer(text, add_special_tokens=False).input_ids)

    questions = [
        "Write a short poem about the sea.",
        "Why is the sky blue?",
        "Name three primary colors.",
        "What is the tallest mountain on Earth?",
        "How do bees make honey?",
    ]
    # Long prompts and few output tokens: prefill is cheap, each decode step is not.
    texts = [
        "The history of the printing press begins in the fifteenth century, when Johannes "
        "Gutenberg combined movable metal type, oil-based ink and a screw press. Within fifty "
        "years",
        "def binary_search(items, target):\n    lo, hi = 0, len(items) - 1\n    while lo <= hi:"
        "\n        mid = (lo + hi) // 2\n",
    ]
    arrivals = [
        Arrival(f"w0-{i}", ids(SYSTEM + CHAT.format(q)), max_tokens=14, wave=0, delay_steps=i)
        for i, q in enumerate(questions[:3])
    ]
    arrivals += [Arrival(f"w1-{i}", ids(t), max_tokens=8, wave=1) for i, t in enumerate(texts)]
    arrivals += [
        Arrival(f"w2-{i}", ids(SYSTEM + CHAT.format(q)), max_tokens=6, wave=2, delay_steps=2 * i)
        for i, q in enumerate(questions[3:])
    ]
    return arrivals


@pytest.mark.slow
def test_smollm2_preemption_and_eviction_match_transformers() -> None:
    gguf = default_model_path()
    config, tensors, _ = read_gguf_cached(gguf)
    hf = transformers_llama_on(config, tensors)
    tokenizer = transformers.AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    run_and_check(
        None,
        load_model(None, quantization="none"),  # widened: transformers' float32
        hf,
        smol_arrivals(tokenizer),
        block_size=SMOL_BLOCK_SIZE,
        num_kv_blocks=SMOL_NUM_BLOCKS,
    )
