"""GGUF blocks as integer codes, and codes as 4-bit planes: exact against gguf's reference.

The reference is the gguf package's own ``dequantize`` of the same bytes (written from
ggml's C, independent of ours). Blocks come from ``gguf.quants.quantize`` of real weights
where the package can quantize, and from random codes with sane scales otherwise (the
K-quants); every bit pattern of the codes is valid.
"""

from __future__ import annotations

import gguf
import numpy as np
import pytest
from gguf.quants import dequantize
from testkit.quant_blocks import random_blocks

from kvflow.engine_worker.model.quant.gguf_codes import (
    QUANTIZED_TYPES,
    GroupedCodes,
    QuantizedTensor,
    decode,
)
from kvflow.engine_worker.model.quant.planes import num_planes_for, stack_rows, to_planes

ROWS, COLS = 48, 512
QUANTIZABLE = ("Q4_0", "Q4_1", "Q5_0", "Q5_1", "Q8_0")


def blocks(type_name: str, *, seed: int = 0) -> np.ndarray:
    if type_name in QUANTIZABLE:
        weights = np.random.default_rng(seed).normal(0, 0.05, (ROWS, COLS)).astype(np.float32)
        quantized: np.ndarray = gguf.quants.quantize(weights, gguf.GGMLQuantizationType[type_name])
        return quantized
    return random_blocks(type_name, ROWS, COLS, std=0.05, seed=seed)


def reference(type_name: str, raw: np.ndarray) -> np.ndarray:
    weights: np.ndarray = dequantize(raw, gguf.GGMLQuantizationType[type_name])
    return weights.reshape(ROWS, COLS)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_codes_times_scales_are_the_reference_weights(type_name: str) -> None:
    raw = blocks(type_name)
    grouped = decode(type_name, raw, ROWS, COLS)
    assert grouped.codes.min() >= grouped.min_code and grouped.codes.max() <= grouped.max_code
    # The same products in float32, up to the order of the multiplications (Q6_K: d * (sc
    # * q) here against (d * sc) * q there).
    np.testing.assert_allclose(grouped.dequantize(), reference(type_name, raw), rtol=1e-6, atol=0)


@pytest.mark.parametrize(
    ("low", "high", "planes", "bias"),
    [
        (-8, 7, 1, 0),  # Q4_0
        (0, 15, 1, 8),  # Q4_1, Q4_K
        (-16, 15, 2, 0),  # Q5_0
        (0, 31, 2, 16),  # Q5_1, Q5_K
        (-128, 127, 2, 0),  # Q8_0
        (-4064, 4096, 4, 16),  # Q6_K: scale times code
    ],
)
def test_the_fewest_planes_whose_top_nibble_holds_the_codes(
    low: int, high: int, planes: int, bias: int
) -> None:
    assert num_planes_for(low, high) == (planes, bias)


@pytest.mark.parametrize("type_name", QUANTIZED_TYPES)
def test_planes_hold_the_same_weights(type_name: str) -> None:
    grouped = decode(type_name, blocks(type_name, seed=1), ROWS, COLS)
    planes = to_planes(grouped)
    assert planes.codes.dtype == np.uint8 and planes.codes.max() <= 15
    assert planes.num_planes == num_planes_for(grouped.min_code, grouped.max_code)[0]
    np.testing.assert_allclose(planes.dequantize(), grouped.dequantize(), rtol=1e-6, atol=1e-7)
    # Zeros the kernels read in bf16 exactly as their scales: the top plane's is 0, the
    # lower planes' (but plane 0's, which carries the offsets) 8 times their scale.
    groups = COLS // planes.group_size
    for p in range(1, planes.num_planes):
        zeros = planes.zeros[:, p * groups : (p + 1) * groups]
        scales = planes.scales[:, p * groups : (p + 1) * groups]
        expected = 0 if p == planes.num_planes - 1 else 8 * scales
        np.testing.assert_array_equal(zeros, expected)


def test_a_smaller_group_repeats_the_scales() -> None:
    grouped = decode("Q6_K", blocks("Q6_K"), ROWS, COLS)
    wide, narrow = to_planes(grouped), to_planes(grouped, group_size=32)
    assert (wide.group_size, narrow.group_size) == (256, 32)
    np.testing.assert_allclose(narrow.dequantize(), wide.dequantize(), rtol=0, atol=0)


def test_stacked_rows_are_the_parts_in_order() -> None:
    first = to_planes(decode("Q4_1", blocks("Q4_1", seed=2), ROWS, COLS))
    second = to_planes(decode("Q4_1", blocks("Q4_1", seed=3), ROWS, COLS))
    stacked = stack_rows([first, second])
    np.testing.assert_array_equal(stacked.dequantize()[:ROWS], first.dequantize())
    np.testing.assert_array_equal(stacked.dequantize()[ROWS:], second.dequantize())
    np.testing.assert_array_equal(stacked.take_rows(slice(ROWS, None)).codes, second.codes)


def test_a_quantized_tensor_reads_its_rows_in_the_order_given() -> None:
    raw = blocks("Q8_0")
    order = np.random.default_rng(0).permutation(ROWS)
    tensor = QuantizedTensor("Q8_0", raw, (ROWS, COLS), order)
    codes = tensor.codes()
    assert isinstance(codes, GroupedCodes)
    np.testing.assert_array_equal(codes.dequantize(), reference("Q8_0", raw)[order])
