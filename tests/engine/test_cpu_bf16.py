"""A bf16 model on the CPU: its matmuls run in bf16, its attention in bf16 where the CPU
multiplies bf16 natively and in float32 elsewhere (``attention.compute_dtype``).

The cache stays bf16 either way (the memory ``--kv-cache-gib`` promises buys as many tokens
as the dtype says). Attending in float32, K/V are widened where attention reads them and
the decode workspace is float32 so that reading a slot converts nothing; widening bf16 is
exact, so the workspace and the gather path attend over the same values. Attending in
bf16, nothing is converted at all. Which one the CPU gets is patched here, so both run on
any machine; how close bf16 attention stays to float32 is tests/engine/test_bf16_attention.py's.
"""

from __future__ import annotations

from typing import Any
from unittest import mock

import pytest
import torch
import torch.nn.functional as F
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.core.engine import Engine
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.model import attention
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.settings import WorkerSettings

PROMPT_LENS = (5, 19, 40, 33, 12, 27)
MAX_TOKENS = 12


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = write_tiny_llama(tmp_path_factory.mktemp("bf16") / "tiny", seed=3)
    return str(path), load_model(path, dtype=torch.bfloat16)


def bf16_engine(tiny: tuple[str, Any], **overrides: Any) -> Engine:
    path, loaded = tiny
    settings = WorkerSettings(model=path, dtype="bfloat16", num_kv_blocks=256, **overrides)
    return build_worker(settings, loaded=loaded).engine


def generate(engine: Engine) -> dict[str, list[int]]:
    """Every prompt at once (batched decodes), then the first again (a cached prefix)."""
    params = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
    prompts = [[(7 * i + 3 * n) % 500 + 3 for i in range(n)] for n in PROMPT_LENS]
    outputs: dict[str, list[int]] = {}

    def drain() -> None:
        while engine.has_unfinished_requests:
            for out in engine.step():
                outputs.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)

    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    drain()
    engine.add_request("again", prompts[0], params)
    drain()
    return outputs


class SdpaDtypes:
    """The dtypes of every SDPA call's query, keys and values; the real SDPA runs."""

    def __init__(self) -> None:
        self.seen: list[tuple[torch.dtype, ...]] = []
        self._real = F.scaled_dot_product_attention

    def __call__(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, **kw: Any) -> Any:
        self.seen.append((q.dtype, k.dtype, v.dtype))
        return self._real(q, k, v, **kw)


# Decodes through the CPU's paged kernel (the default where attention computes in float32),
# the decode workspace, or the gather.
MODES: dict[str, dict[str, Any]] = {
    "paged": {},
    "workspace": {"paged_attention": False},
    "gather": {"paged_attention": False, "decode_workspace_gib": 0.0},
}


@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
@pytest.mark.parametrize("mode", list(MODES))
def test_a_bf16_model_attends_in_its_compute_dtype_and_keeps_its_cache_in_bf16(
    tiny: tuple[str, Any],
    mode: str,
    native: bool,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(attention, "cpu_has_native_bf16", lambda: native)
    wide = torch.bfloat16 if native else torch.float32
    engine = bf16_engine(tiny, **MODES[mode])
    runner: Any = engine.runner
    # The kernel reads the bf16 cache in place whatever attention's dtype (it computes in
    # float32; bf16 queries are widened).
    paged = mode == "paged"
    assert runner.paged_kernel == paged
    spy = SdpaDtypes()
    with mock.patch.object(F, "scaled_dot_product_attention", spy):
        outputs = generate(engine)
    assert all(len(tokens) == MAX_TOKENS for tokens in outputs.values())
    # Prefills, cached-prefix prefills and (but through the kernel) batched decodes all went
    # through SDPA...
    layers = runner.model.config.num_hidden_layers
    assert len(spy.seen) > (1 if paged else 2) * len(PROMPT_LENS) * layers
    # ...in the compute dtype every time, over a cache that stays bf16.
    assert set(spy.seen) == {(wide,) * 3}
    assert {c.dtype for c in runner.kv_caches} == {torch.bfloat16}
    if not paged and mode != "gather":
        assert runner.workspace.dtype == wide
        assert runner.workspace.num_bytes > 0, "the batched decodes never used the workspace"
    else:
        assert runner.workspace is None


@pytest.mark.parametrize("kv_cache_dtype", ["auto", "int8"])
@pytest.mark.parametrize("native", [False, True], ids=["emulated", "native"])
def test_bf16_tokens_are_the_same_through_the_kernel_the_workspace_and_the_gather(
    tiny: tuple[str, Any], native: bool, kv_cache_dtype: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The workspace and the gather attend over the same values of the same bf16 cache, in
    the same dtype, and so does the kernel where attention computes in float32 (emulated).
    An int8 cache's step tokens are dequantized straight to the compute dtype, as its
    gathers and fills are: rounded through bf16 on the way to float32, the step's own
    tokens would differ from the copies the next steps read.

    With native bf16 the kernel still decodes in float32 (bf16 queries widened) where the
    others decode in bf16 SDPA: a different sum, so a near-tie of this random model may go
    either way (on an AVX2 EPYC one did, at the fifth token of a request). There the first
    tokens, from the prefills' bf16 SDPA on every path, must agree; how close the kernel's
    bf16 decodes stay is tests/engine/test_bf16_attention.py's."""
    monkeypatch.setattr(attention, "cpu_has_native_bf16", lambda: native)
    runs = {m: generate(bf16_engine(tiny, kv_cache_dtype=kv_cache_dtype, **o))
            for m, o in MODES.items()}  # fmt: skip
    gathered = runs["gather"]
    assert runs["workspace"] == gathered
    if native:
        first = {request: tokens[0] for request, tokens in gathered.items()}
        assert {request: tokens[0] for request, tokens in runs["paged"].items()} == first
    else:
        assert runs["paged"] == gathered
    # A sanity check that the prompts do not all collapse onto one token.
    assert len({t for tokens in gathered.values() for t in tokens}) > MAX_TOKENS
