"""bench/engine_roofline.py's arithmetic (roofline_gemm.py, roofline_stream.py): the bytes
a batch-1 decode step reads (float and quantized weights, tied and untied heads), the
products its GEMM ceiling times, and the streamed bandwidth's measurement. Never speed: a
benchmark is not a test."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from testkit.tiny_gguf import QuantType, write_tiny_gguf
from testkit.tiny_model import write_tiny_llama

ROOT = Path(__file__).resolve().parents[2]

import roofline_gemm  # noqa: E402
import roofline_stream  # noqa: E402

from kvflow.engine_worker.model.loader import load_model  # noqa: E402

HIDDEN, FFN, LAYERS, HEADS, KV_HEADS, VOCAB = 64, 128, 2, 4, 2, 512
HEAD_DIM = HIDDEN // HEADS


def matrices_per_layer() -> int:
    return HIDDEN * HEAD_DIM * (2 * HEADS + 2 * KV_HEADS) + 3 * HIDDEN * FFN


def tiny(tmp_path: Path, tied: bool) -> Path:
    return write_tiny_llama(
        tmp_path / f"tiny-{tied}", vocab_size=VOCAB, tie_word_embeddings=tied, seed=0
    )


@pytest.mark.parametrize("tied", [False, True])
def test_float_step_bytes_are_every_matrix_once_and_the_head(tmp_path: Path, tied: bool) -> None:
    model, config = load_model(tiny(tmp_path, tied), dtype=torch.float32)
    norms = (2 * LAYERS + 1) * HIDDEN
    # The head is read whole every step; the embedding table apart from it only a row.
    expected = 4 * (LAYERS * matrices_per_layer() + VOCAB * HIDDEN + norms)
    assert roofline_gemm.step_weight_bytes(model) == expected
    assert roofline_gemm.matmul_params(config) == LAYERS * matrices_per_layer() + VOCAB * HIDDEN
    ops = roofline_gemm.decode_ops(model)
    assert len(ops) == 4 * LAYERS + 1
    x = {w: torch.randn(3, w) for w, _ in ops}
    # Each product is the model's own: the last one gives the logits.
    assert ops[-1][1](x[HIDDEN]).shape == (3, VOCAB)


def test_quantized_step_bytes_count_the_codes_as_stored(tmp_path: Path) -> None:
    path = write_tiny_gguf(tiny(tmp_path, False), tmp_path / "q.gguf", matrix_type=QuantType.Q8_0)
    quantized, _ = load_model(path, dtype=torch.float32, quantization="auto")
    widened, _ = load_model(path, dtype=torch.float32, quantization="none")
    q_bytes, f_bytes = (
        roofline_gemm.step_weight_bytes(quantized),
        roofline_gemm.step_weight_bytes(widened),
    )
    # Q8_0: 34 bytes per 32 weights, against float32's 128 (the layout may pad a little).
    assert 0.2 * f_bytes < q_bytes < 0.4 * f_bytes, (q_bytes, f_bytes)
    ops = roofline_gemm.decode_ops(quantized)
    assert len(ops) == 4 * LAYERS + 1
    for width, op in ops:
        assert op(torch.randn(2, width)).shape[0] == 2


def test_stream_bandwidth_reports_read_and_copy() -> None:
    assert roofline_stream.last_level_cache_bytes() > 0
    r = roofline_stream.stream_bandwidth(16 << 20, passes=3)
    assert r["bytes"] == 16 << 20 and r["threads"] == torch.get_num_threads()
    assert 0 < r["read_gb_s"] <= r["read_best_gb_s"]
    assert 0 < r["copy_gb_s"] <= r["copy_best_gb_s"]
    assert 0 < r["gemv_gb_s"] <= r["gemv_best_gb_s"]
    assert r["bandwidth_gb_s"] == max(r["read_gb_s"], r["gemv_gb_s"], r["copy_gb_s"])
