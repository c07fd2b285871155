"""Valid llama.cpp quantized blocks with random codes, for types the gguf package cannot
quantize (the K-quants, and types kvflow refuses).

Every byte is random except the float16 scale fields, which are set so the weights come out
with about the standard deviation asked for: finite, and of the size a real layer has, so a
model built from them keeps unit-scale activations. The gguf package's ``dequantize``
reads them (the reference the tests hold kvflow's decoders to).
"""

from __future__ import annotations

import numpy as np

#: type -> (weights per block, bytes per block, [(byte offset of an f16 field, its value as
#: a multiple of std)]). Scale fields: d; for types with a min, dmin or m (negative: it
#: centres codes that are all >= 0).
_LAYOUTS: dict[str, tuple[int, int, list[tuple[int, float]]]] = {
    "Q4_0": (32, 18, [(0, 1 / 4.6)]),
    "Q4_1": (32, 20, [(0, 1 / 4.6), (2, -7.5 / 4.6)]),
    "Q5_0": (32, 22, [(0, 1 / 9.2)]),
    "Q5_1": (32, 24, [(0, 1 / 9.2), (2, -15.5 / 9.2)]),
    "Q8_0": (32, 34, [(0, 1 / 74.0)]),
    "Q4_K": (256, 144, [(0, 1 / (31 * 4.6)), (2, 7.5 / (31 * 4.6))]),
    "Q5_K": (256, 176, [(0, 1 / (31 * 9.2)), (2, 15.5 / (31 * 9.2))]),
    "Q6_K": (256, 210, [(208, 1 / (74 * 18.5))]),
    "Q2_K": (256, 84, [(80, 1 / (7 * 1.1)), (82, 1 / (7 * 1.1))]),
}


def random_blocks(type_name: str, rows: int, cols: int, *, std: float, seed: int) -> np.ndarray:
    """``[rows, cols]`` weights as ``type_name`` blocks: ``[rows, row bytes]`` uint8."""
    per_block, block_bytes, fields = _LAYOUTS[type_name]
    assert cols % per_block == 0, (type_name, cols)
    rng = np.random.default_rng(seed)
    blocks = rng.integers(0, 256, (rows * cols // per_block, block_bytes), dtype=np.uint8)
    for offset, multiple in fields:
        value = np.full(len(blocks), multiple * std, dtype=np.float16)
        blocks[:, offset : offset + 2] = value.view(np.uint8).reshape(-1, 2)
    return blocks.reshape(rows, -1)
