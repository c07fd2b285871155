"""GGUF models kept quantized: what they hold, and that they compute what the file says.

The yardstick for the quantized path is the same file widened to float32
(``quantization="none"``), which test_loader_gguf.py holds to transformers at 1e-4. The
quantized path multiplies in bf16 (torch's int4 kernels take bf16 activations, and large
batches run bf16 GEMMs), so it may differ from float32 as much as the whole model run in
bf16 does: the bound is twice what the widened model loaded in bf16 errs by, on the same
tokens. A prompt of 140 tokens runs the widened-GEMM path (``Int4Weight``: from 128 rows
on, 48 with AMX); the decode steps after it, the kernel.
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

from kvflow.engine_worker.memory.weight_memory import weight_memory
from kvflow.engine_worker.model.default_model import default_model_path
from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.model.linear import REFINE_TOP_K, DenseWeight, Embedding, head_logits
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.model.quant import int4_weight
from kvflow.engine_worker.model.quant.gguf_codes import decode
from kvflow.engine_worker.model.quant.int4_weight import Int4Weight
from kvflow.engine_worker.model.quant.planes import to_planes

T = gguf.GGMLQuantizationType
K_QUANT_SHAPE = {"hidden_size": 256, "intermediate_size": 512}  # rows of 256-weight blocks


@pytest.fixture(autouse=True)
def private_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))


def tiny_gguf(tmp_path: Path, kind: T, **options: Any) -> Path:
    part_types = options.pop("part_types", None)
    folder = write_tiny_llama(tmp_path / "tiny", vocab_size=512, seed=3, **options)
    return write_tiny_gguf(folder, tmp_path / "tiny.gguf", matrix_type=kind, part_types=part_types)


def logits(path: Path, **load: Any) -> torch.Tensor:
    """A 140-token prompt's logits, then 5 decode steps' (one row each)."""
    model, config = load_model(path, **load)
    steps = PagedSteps(model, config, num_blocks=64, block_size=16)
    tokens = torch.randint(0, 512, (140,), generator=torch.Generator().manual_seed(0)).tolist()
    prompt = steps.step({"a": tokens})["a"]
    decodes = [steps.step({"a": [t]})["a"] for t in tokens[:5]]
    return torch.cat([prompt, *decodes])


def assert_as_close_as_bf16(path: Path) -> None:
    truth = logits(path, quantization="none")
    bf16_error = (logits(path, quantization="none", dtype=torch.bfloat16) - truth).abs().max()
    error = (logits(path) - truth).abs().max()
    assert error <= 2 * bf16_error, f"quantized errs {error:.3g}; bf16 floats {bf16_error:.3g}"


def matrices(model: LlamaForCausalLM) -> list[Any]:
    layers = [(layer.self_attn, layer.mlp) for layer in model.layers]
    linears = [m for attn, mlp in layers for m in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj)]
    return [*linears, *(mlp.down_proj for _, mlp in layers), model.embed_tokens]


@pytest.mark.parametrize(
    ("kind", "options"),
    [
        (T.Q4_0, {}),
        (T.Q4_1, {"num_key_value_heads": 1}),
        (T.Q5_0, {}),
        (T.Q8_0, {"tie_word_embeddings": True}),
        (T.Q4_K, K_QUANT_SHAPE),
        (T.Q5_K, {**K_QUANT_SHAPE, "tie_word_embeddings": True}),
        (T.Q6_K, K_QUANT_SHAPE),
    ],
    ids=lambda v: v.name if isinstance(v, T) else "",
)
def test_every_matrix_stays_quantized_and_computes_within_bf16(
    tmp_path: Path, kind: T, options: dict[str, Any]
) -> None:
    path = tiny_gguf(tmp_path, kind, **options)
    model, _ = load_model(path)
    for matrix in matrices(model):
        assert matrix.weight is None, "a quantized matrix was widened"
    held = weight_memory(model)
    assert set(held) == {"int4", "float32"}  # norms (and RoPE's tables) stay float
    norms = sum(p.nbytes for p in model.parameters())
    assert norms < held["int4"] / 10
    assert_as_close_as_bf16(path)


def test_a_fused_projection_of_mixed_parts_keeps_one_segment_per_format(tmp_path: Path) -> None:
    # As in Q4_K_M files: V in another type than Q and K; here K even left in float.
    path = tiny_gguf(
        tmp_path, T.Q4_0, part_types={"attn_v": T.Q8_0, "attn_k": T.F32, "ffn_up": T.Q4_1}
    )
    model, config = load_model(path)
    qkv = model.layers[0].self_attn.qkv_proj
    assert qkv.segments is not None
    kinds = [type(s) for s in qkv.segments]
    assert kinds == [Int4Weight, DenseWeight, Int4Weight]
    kv_rows = config.num_key_value_heads * config.head_dim
    assert [s.rows for s in qkv.segments] == [config.hidden_size, kv_rows, kv_rows]
    assert [s.num_planes for s in qkv.segments if isinstance(s, Int4Weight)] == [1, 2]
    gate_up = model.layers[0].mlp.gate_up_proj.segments
    assert gate_up is not None and len(gate_up) == 1  # Q4_0 and Q4_1: planes of one format
    assert_as_close_as_bf16(path)


def test_a_type_kvflow_does_not_multiply_is_refused_by_name(tmp_path: Path) -> None:
    path = tiny_gguf(tmp_path, T.Q4_0, part_types={"ffn_down": T.Q2_K}, **K_QUANT_SHAPE)
    with pytest.raises(ModelLoadError, match=r"'blk\.\d\.ffn_down\.weight' is stored as Q2_K") as e:
        load_model(path)
    assert "--quantization none" in str(e.value)
    model, _ = load_model(path, quantization="none")  # widened on request: it loads
    assert weight_memory(model).keys() == {"float32"}


@pytest.mark.parametrize("kernel", ["torch", "gemv-float32", "gemv-int8"])
def test_a_quantized_head_recomputes_its_likeliest_logits_in_float32(
    monkeypatch: pytest.MonkeyPatch, kernel: str
) -> None:
    """torch's int4 kernel computes in bf16 and kvflow's GEMV with int8 activations rounds
    them, so the likeliest logits are recomputed in float32; kvflow's GEMV on float32
    activations sums in float32, so every logit is as exact as those."""
    monkeypatch.setattr(int4_weight, "use_native_gemv", lambda: kernel != "torch")
    activations = "int8" if kernel == "gemv-int8" else "float32"
    monkeypatch.setattr(int4_weight, "gemv_activations", lambda: activations)
    generator = torch.Generator().manual_seed(0)
    weights = torch.randn(512, 64, generator=generator) * 0.3
    # Q8_0 blocks of these weights, as an Embedding (a tied head) holds them.
    raw = gguf.quants.quantize(weights.numpy(), T.Q8_0)
    planes = to_planes(decode("Q8_0", raw, 512, 64))
    head = Embedding(512, 64, dtype=torch.float32, device=torch.device("cpu"))
    head.quantize(Int4Weight(planes))
    assert head.quantized is not None
    exact_weights = head.quantized.dequantize().double()  # as stored: scales in bf16
    hidden = torch.randn(3, 64, generator=generator) * 4  # logits of tens: bf16 steps of 0.1
    got = head_logits(hidden, head)
    exact = (hidden.double() @ exact_weights.T).float()
    top = exact.topk(REFINE_TOP_K).indices
    # The likeliest are float32-exact ...
    torch.testing.assert_close(got.gather(1, top), exact.gather(1, top), rtol=2e-5, atol=2e-4)
    assert head.quantized.int8_activations == (kernel == "gemv-int8")
    if kernel == "gemv-float32":
        torch.testing.assert_close(got, exact, rtol=2e-5, atol=2e-4)
    else:  # ... and the rest carry bf16's or int8's rounding: why the top is recomputed.
        assert (got - exact).abs().max() > 1e-2


@pytest.mark.slow
def test_the_default_model_holds_about_its_file_and_answers_as_widened() -> None:
    """SmolLM2-135M's Q4_1 file: 96.6 MB of tensors, 540 MB widened to float32."""
    model, config = load_model(None)
    reader = gguf.GGUFReader(str(default_model_path()))
    file_bytes = sum(int(t.n_bytes) for t in reader.tensors)
    held = sum(weight_memory(model).values())
    assert held <= 1.3 * file_bytes, (held, file_bytes)
    widened, _ = load_model(None, quantization="none")
    prompt = [504, 3575, 282, 4649, 314]  # "The capital of France is"
    outputs = []
    for candidate in (model, widened):
        steps = PagedSteps(candidate, config, num_blocks=64, block_size=16)
        tokens, new = list(prompt), [prompt]
        for _ in range(8):
            tokens.append(int(steps.step({"a": new[-1]})["a"][-1].argmax()))
            new.append([tokens[-1]])
        outputs.append(tokens[len(prompt) :])
    assert outputs[0] == outputs[1]
    assert outputs[0][0] == 7042  # " Paris"
