"""bf16 attention on a CPU with native bf16 (``attention.compute_dtype``), held to float32.

A bf16 model on a CPU with AMX or AVX512-BF16 attends in bf16: Q, K and V as the model
computed them, the decode workspace in bf16, SDPA in bf16 (float32 accumulation and
softmax inside). Against float32 attention over the same bf16 values, two things must hold:

- the output of ``paged_attention`` on random ragged batches (chunked prefills and decodes
  of 2-160 tokens of context, 9 query heads over 3 KV heads of 64, as SmolLM2) is within
  ``ATOL + RTOL * |reference|`` of the float32 reference, and within
  ``ERROR_RATIO`` times the error float32 attention makes once its output is rounded to
  bf16 (the error the model had before): measured 0.0083 against 0.0078, 1.06x;
- greedy tokens of the real SmolLM2 in bf16, many prompts decoding together, stay as close
  to the float32 model's as float32 attention's do (bf16 weights flip near-ties either
  way; ``test_smollm2_bf16_attention_stays_as_close_to_float32_as_float32_attention``).

Both run on any CPU: which dtype attention picks is patched, the kernels are torch's.
"""

from __future__ import annotations

import random
from typing import Any

import pytest
import torch
from testkit.attend import attend

from kvflow.engine_worker.model import attention
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.decode_workspace import Decode, DecodeWorkspace
from kvflow.engine_worker.model.paged_cache import kv_cache_shape

H, HKV, D, BS = 9, 3, 64, 16
SCALE = D**-0.5
# Elementwise bound on the bf16 path's output against float32 attention's (outputs are of
# order 1: averages of unit-normal values); bf16 keeps 8 bits, 2^-8 = 0.0039.
ATOL, RTOL = 1.6e-2, 1.6e-2
# ...and its largest error at most this many times float32 attention's rounded to bf16.
ERROR_RATIO = 2.0


def attend_f64(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
    """``q`` ``[n, H, D]``, the last ``n`` of a context ``k``/``v`` ``[ctx, Hkv, D]``."""
    n, ctx = q.shape[0], k.shape[0]
    group = H // HKV
    k = k.double().repeat_interleave(group, dim=1)  # [ctx, H, D]
    v = v.double().repeat_interleave(group, dim=1)
    scores = torch.einsum("nhd,chd->hnc", q.double(), k) * SCALE
    q_pos = torch.arange(ctx - n, ctx)[:, None]
    scores = scores.masked_fill(torch.arange(ctx)[None, :] > q_pos, -torch.inf)
    return torch.einsum("hnc,chd->nhd", scores.softmax(-1), v)


class Seq:
    def __init__(self, rid: str, length: int, gen: torch.Generator) -> None:
        self.rid = rid
        self.q = torch.randn(length, H, D, generator=gen).bfloat16()
        self.k = torch.randn(length, HKV, D, generator=gen).bfloat16()
        self.v = torch.randn(length, HKV, D, generator=gen).bfloat16()
        self.done = 0
        self.blocks: list[int] = []


def run_ragged(native: bool, monkeypatch: pytest.MonkeyPatch) -> tuple[list[Any], int]:
    """Steps of random ragged traffic through ``paged_attention`` with bf16 Q/K/V and a
    bf16 cache (and a workspace in the dtype attention computes in); per step its output
    and the float64 reference. Returns those pairs and how many steps used the workspace."""
    monkeypatch.setattr(attention, "cpu_has_native_bf16", lambda: native)
    wide = attention.compute_dtype(torch.bfloat16, torch.device("cpu"))
    assert wide == (torch.bfloat16 if native else torch.float32)
    rnd = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    num_blocks = 600
    shape = kv_cache_shape(num_blocks=num_blocks, block_size=BS, num_kv_heads=HKV, head_dim=D)
    cache = torch.zeros(shape, dtype=torch.bfloat16)
    ws = DecodeWorkspace(
        num_layers=1,
        num_kv_heads=HKV,
        head_dim=D,
        block_size=BS,
        dtype=wide,
        device=torch.device("cpu"),
        max_bytes=1 << 30,
    )
    free = list(range(num_blocks))
    rnd.shuffle(free)
    seqs = [Seq(f"s{i}", rnd.randint(2, 160), gen) for i in range(24)]
    pairs: list[Any] = []
    workspace_steps = 0
    while any(s.done < len(s.q) for s in seqs):
        batch: list[tuple[Seq, int]] = []
        budget = 256
        for s in seqs:
            todo = len(s.q) - s.done
            n = 1 if s.done and todo else min(todo, rnd.randint(8, 64))
            if todo <= 0 or budget < n:
                continue
            budget -= n
            need = -(-(s.done + n) // BS) - len(s.blocks)
            s.blocks.extend(free.pop() for _ in range(need))
            batch.append((s, n))
        rows, row = [], 0
        for _, n in batch:
            rows.append(row)
            row += n
        decodes = [
            Decode(s.rid, r, s.done + 1, s.blocks, len(s.q))
            for (s, n), r in zip(batch, rows, strict=True)
            if n == 1
        ]
        step = ws.plan(decodes, all_rows=len(decodes) == row)
        workspace_steps += step is not None
        meta = AttentionMetadata.build(
            query_lens=[n for _, n in batch],
            context_lens=[s.done + n for s, n in batch],
            block_tables=[list(s.blocks) for s, _ in batch],
            block_size=BS,
            workspace=step,
        )
        q = torch.cat([s.q[s.done : s.done + n] for s, n in batch])
        k = torch.cat([s.k[s.done : s.done + n] for s, n in batch])
        v = torch.cat([s.v[s.done : s.done + n] for s, n in batch])
        got = attend(q, k, v, cache, meta.layer(0), SCALE)
        assert got.dtype == torch.bfloat16
        want = torch.cat(
            [
                attend_f64(s.q[s.done : s.done + n], s.k[: s.done + n], s.v[: s.done + n])
                for s, n in batch
            ]
        )
        pairs.append((got, want))
        for s, n in batch:
            s.done += n
    return pairs, workspace_steps


def test_bf16_attention_on_ragged_gqa_batches_is_within_tolerance_of_float32(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    bf16_pairs, bf16_ws = run_ragged(True, monkeypatch)
    f32_pairs, f32_ws = run_ragged(False, monkeypatch)
    assert bf16_ws > 50 and f32_ws == bf16_ws, "the decodes went through the workspace"
    bf16_err = max((got.double() - want).abs().max().item() for got, want in bf16_pairs)
    f32_err = max((got.double() - want).abs().max().item() for got, want in f32_pairs)
    for got, want in bf16_pairs:
        torch.testing.assert_close(got.double(), want, atol=ATOL, rtol=RTOL)
    print(f"max error: bf16 {bf16_err:.4g}, float32 rounded to bf16 {f32_err:.4g}")
    assert bf16_err <= ERROR_RATIO * f32_err, (bf16_err, f32_err)


# Greedy parity on the real model: prompts of several kinds and lengths, decoding together
# (the workspace's batched path), each for NEW_TOKENS tokens.
CHAT = "<|im_start|>user\n{}<|im_end|>\n<|im_start|>assistant\n"
PARITY_PROMPTS = [
    "The capital of France is",
    CHAT.format("Write a short poem about the sea."),
    CHAT.format("Explain in two sentences why the sky is blue by day and red at sunset."),
    CHAT.format("List three prime numbers greater than 100."),
    "def fibonacci(n):\n    ",
    CHAT.format("Translate 'good morning, how are you?' into French and Spanish."),
    "Once upon a time, in a small village by the mountains, there lived",
    CHAT.format("What is the boiling point of water at sea level, in Celsius and Fahrenheit?"),
]
NEW_TOKENS = 32
# bf16 attention's tokens shared with the float32 model, at least this share of float32
# attention's (the bf16 model's own) before their first difference.
PARITY_SHARE = 0.75


def greedy_smollm2(
    dtype: torch.dtype,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
    loaded: Any,
    paged: bool = False,
) -> list[list[int]]:
    """Every prompt's NEW_TOKENS greedy tokens, all decoding together (``paged``: their
    decodes through the CPU's paged kernel, in float32, rather than the workspace)."""
    from transformers import AutoTokenizer

    from kvflow.engine_worker.app import build_worker
    from kvflow.engine_worker.core.sampling_params import SamplingParams
    from kvflow.engine_worker.model.default_model import default_model_path
    from kvflow.engine_worker.settings import WorkerSettings

    monkeypatch.setattr(attention, "cpu_has_native_bf16", lambda: native)
    path = default_model_path()
    tokenizer = AutoTokenizer.from_pretrained(path.parent, gguf_file=path.name)
    # The workspace's arms attend their decodes through it in the compute dtype (the default
    # would read the cache through the CPU's paged kernel, in float32): only the dtypes differ.
    settings = WorkerSettings(
        model=None, dtype=str(dtype).removeprefix("torch."), kv_cache_gib=0.25,
        paged_attention=paged,
    )  # fmt: skip
    engine = build_worker(settings, loaded=loaded).engine
    runner: Any = engine.runner
    if paged:
        assert runner.paged_kernel and runner.workspace is None
    else:
        assert runner.workspace.dtype == attention.compute_dtype(dtype, torch.device("cpu"))
    params = SamplingParams(temperature=0.0, max_tokens=NEW_TOKENS, ignore_eos=True)
    for i, text in enumerate(PARITY_PROMPTS):
        engine.add_request(f"p{i}", tokenizer.encode(text), params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
    return [outputs[f"p{i}"] for i in range(len(PARITY_PROMPTS))]


def agreed(a: list[list[int]], b: list[list[int]]) -> int:
    """Tokens two generations share before each prompt's first difference, summed."""
    total = 0
    for x, y in zip(a, b, strict=True):
        total += next((i for i, (s, t) in enumerate(zip(x, y, strict=True)) if s != t), len(x))
    return total


@pytest.mark.slow
def test_smollm2_bf16_attention_stays_as_close_to_float32_as_float32_attention(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """SmolLM2-135M (the built-in GGUF, widened), 8 prompts decoding together for 32 tokens.

    bf16 weights alone flip SmolLM2's near-ties (the float32 model and the bf16 model with
    float32 attention share 112 of 256 tokens before each prompt's first difference), so
    bitwise greedy parity is no bf16 model's to keep. What bf16 attention must not do is
    stray further: its tokens share at least ``PARITY_SHARE`` as many with the float32
    model as float32 attention's do (measured 99 against 112, 0.88; it strays earlier on
    two prompts and later on two), and on at least three prompts it picks float32
    attention's every token (measured 3 of 8).

    The default on such a CPU, decodes through the paged kernel in float32 and prefills in
    bf16, strays no further than bf16 attention may."""
    from kvflow.engine_worker.model.loader import load_model

    truth = greedy_smollm2(torch.float32, False, monkeypatch, load_model(None, quantization="none"))
    loaded = load_model(None, dtype=torch.bfloat16, quantization="none")
    bf16 = greedy_smollm2(torch.bfloat16, True, monkeypatch, loaded)
    f32 = greedy_smollm2(torch.bfloat16, False, monkeypatch, loaded)
    assert all(len(tokens) == NEW_TOKENS for tokens in bf16 + f32 + truth)
    assert agreed(bf16, truth) >= PARITY_SHARE * agreed(f32, truth), (
        agreed(bf16, truth),
        agreed(f32, truth),
    )
    assert sum(x == y for x, y in zip(bf16, f32, strict=True)) >= 3
    paged = greedy_smollm2(torch.bfloat16, True, monkeypatch, loaded, paged=True)
    assert agreed(paged, truth) >= PARITY_SHARE * agreed(f32, truth), (
        agreed(paged, truth),
        agreed(f32, truth),
    )
