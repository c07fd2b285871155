"""GGUF quantized blocks as integer codes with per-group scales: ``w = code * scale + offset``.

llama.cpp stores a quantized matrix row by row, each row a run of blocks; every type below
reduces to small integers times a scale shared by a group of consecutive weights, plus an
offset shared by the same group:

| type | group | code | scale | offset |
|---|---|---|---|---|
| Q4_0 | 32 | q - 8 in [-8, 7] | d | 0 |
| Q4_1 | 32 | q in [0, 15] | d | m |
| Q5_0 | 32 | q - 16 in [-16, 15] | d | 0 |
| Q5_1 | 32 | q in [0, 31] | d | m |
| Q8_0 | 32 | q in [-128, 127] | d | 0 |
| Q4_K | 32 (of a 256 super-block) | q in [0, 15] | d * sc | -dmin * mn |
| Q5_K | 32 (of a 256 super-block) | q in [0, 31] | d * sc | -dmin * mn |
| Q6_K | 256 | sc * (q - 32), 13 bits | d | 0 |

Q6_K scales every 16 weights by an 8-bit integer ``sc``; torch's int4 kernels take groups
of 32 or more, so ``sc`` is folded into the code: the product of two small integers, exact.

Pure numpy over the file's bytes; ``planes.py`` turns the codes into 4-bit planes. Every
decoder is checked against ``gguf.quants.dequantize`` (the gguf package's reference) in
``tests/engine/test_quant_gguf_codes.py``.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

#: Weights per block of each type we decode, and the block's bytes.
_BLOCKS: dict[str, tuple[int, int]] = {
    "Q4_0": (32, 18),
    "Q4_1": (32, 20),
    "Q5_0": (32, 22),
    "Q5_1": (32, 24),
    "Q8_0": (32, 34),
    "Q4_K": (256, 144),
    "Q5_K": (256, 176),
    "Q6_K": (256, 210),
}
QUANTIZED_TYPES = tuple(_BLOCKS)


@dataclass(frozen=True)
class GroupedCodes:
    """A ``[rows, cols]`` matrix as ``codes * scales + offsets``, one scale per group of
    ``group_size`` consecutive weights of a row. ``codes`` lie in ``[min_code, max_code]``."""

    codes: np.ndarray  # [rows, cols] int16
    scales: np.ndarray  # [rows, cols / group_size] float32
    offsets: np.ndarray  # [rows, cols / group_size] float32
    group_size: int
    min_code: int
    max_code: int

    @property
    def shape(self) -> tuple[int, int]:
        rows, cols = self.codes.shape
        return int(rows), int(cols)

    def take(self, rows: tuple[int, int] | None, cols: tuple[int, int] | None) -> GroupedCodes:
        """The codes of ``W[rows, cols]`` (a tensor-parallel rank's slice); ``cols`` must
        start and end on a group's edge (its groups' scales go with them)."""
        codes, scales, offsets = self.codes, self.scales, self.offsets
        if rows is not None:
            codes, scales, offsets = (a[rows[0] : rows[1]] for a in (codes, scales, offsets))
        if cols is not None:
            start, stop = cols
            if start % self.group_size or stop % self.group_size:
                raise ValueError(
                    f"columns {start}:{stop} split groups of {self.group_size} weights"
                )
            group = slice(start // self.group_size, stop // self.group_size)
            codes, scales, offsets = codes[:, start:stop], scales[:, group], offsets[:, group]
        return GroupedCodes(codes, scales, offsets, self.group_size, self.min_code, self.max_code)

    def dequantize(self) -> np.ndarray:
        """The float32 weights (for tests and for ``--quantization none``)."""
        rows, cols = self.shape
        grouped = self.codes.reshape(rows, cols // self.group_size, self.group_size)
        weights: np.ndarray = grouped * self.scales[..., None] + self.offsets[..., None]
        return weights.reshape(rows, cols).astype(np.float32)


@dataclass(frozen=True)
class QuantizedTensor:
    """A checkpoint matrix still in its file's blocks: decoded when the loader reaches it.

    ``raw`` is the tensor's bytes (a view of the memory-mapped file); ``row_order``, when
    set, is the order to read its rows in (a GGUF's Q and K rows are permuted per head).
    """

    type_name: str
    raw: np.ndarray
    shape: tuple[int, int]  # [rows, cols], as a Hugging Face checkpoint names them
    row_order: np.ndarray | None = None

    def codes(self) -> GroupedCodes:
        grouped = decode(self.type_name, self.raw, *self.shape)
        if self.row_order is None:
            return grouped
        order = self.row_order
        return GroupedCodes(
            grouped.codes[order],
            grouped.scales[order],
            grouped.offsets[order],
            grouped.group_size,
            grouped.min_code,
            grouped.max_code,
        )


def block_size(type_name: str) -> int:
    """Weights per block of ``type_name`` (a row's length must be a multiple of it)."""
    return _BLOCKS[type_name][0]


def decode(type_name: str, raw: np.ndarray, rows: int, cols: int) -> GroupedCodes:
    """The codes of a ``[rows, cols]`` matrix stored as ``type_name`` blocks in ``raw``.

    ``raw`` holds the tensor's bytes (any shape, uint8, row-major as in the file).
    """
    weights_per_block, bytes_per_block = _BLOCKS[type_name]
    assert cols % weights_per_block == 0, (type_name, cols)
    blocks = np.ascontiguousarray(raw).view(np.uint8).reshape(-1, bytes_per_block)
    assert blocks.shape[0] == rows * cols // weights_per_block, (blocks.shape, rows, cols)
    decoded = _DECODERS[type_name](blocks)
    codes = decoded.codes.reshape(rows, cols)
    groups = cols // decoded.group_size
    return GroupedCodes(
        codes=codes,
        scales=decoded.scales.reshape(rows, groups),
        offsets=decoded.offsets.reshape(rows, groups),
        group_size=decoded.group_size,
        min_code=decoded.min_code,
        max_code=decoded.max_code,
    )


@dataclass(frozen=True)
class _Decoded:
    codes: np.ndarray  # [blocks, weights per block] int16
    scales: np.ndarray  # [blocks, groups per block] float32
    offsets: np.ndarray
    group_size: int
    min_code: int
    max_code: int


def _f16(blocks: np.ndarray, start: int) -> np.ndarray:
    """The float16 at byte ``start`` of every block, widened: ``[blocks, 1]``."""
    return blocks[:, start : start + 2].copy().view(np.float16).astype(np.float32)


def _nibbles_32(packed: np.ndarray) -> np.ndarray:
    """16 bytes -> 32 codes: low nibbles are weights 0-15, high nibbles weights 16-31."""
    return np.concatenate([packed & 0x0F, packed >> 4], axis=-1).astype(np.int16)


def _high_bits_32(qh: np.ndarray) -> np.ndarray:
    """Q5_0/Q5_1's 4 bytes of fifth bits (a little-endian uint32): bit j is weight j's."""
    bits = np.unpackbits(qh, axis=-1, bitorder="little")  # [blocks, 32], bit j of the uint32
    return bits.astype(np.int16)


def _q4_0(blocks: np.ndarray) -> _Decoded:
    codes = _nibbles_32(blocks[:, 2:18]) - 8
    zeros = np.zeros((len(blocks), 1), np.float32)
    return _Decoded(codes, _f16(blocks, 0), zeros, 32, -8, 7)


def _q4_1(blocks: np.ndarray) -> _Decoded:
    return _Decoded(_nibbles_32(blocks[:, 4:20]), _f16(blocks, 0), _f16(blocks, 2), 32, 0, 15)


def _q5_0(blocks: np.ndarray) -> _Decoded:
    codes = (_nibbles_32(blocks[:, 6:22]) | (_high_bits_32(blocks[:, 2:6]) << 4)) - 16
    zeros = np.zeros((len(blocks), 1), np.float32)
    return _Decoded(codes, _f16(blocks, 0), zeros, 32, -16, 15)


def _q5_1(blocks: np.ndarray) -> _Decoded:
    codes = _nibbles_32(blocks[:, 8:24]) | (_high_bits_32(blocks[:, 4:8]) << 4)
    return _Decoded(codes, _f16(blocks, 0), _f16(blocks, 2), 32, 0, 31)


def _q8_0(blocks: np.ndarray) -> _Decoded:
    codes = blocks[:, 2:34].copy().view(np.int8).astype(np.int16)
    zeros = np.zeros((len(blocks), 1), np.float32)
    return _Decoded(codes, _f16(blocks, 0), zeros, 32, -128, 127)


def _k_scales(packed: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Q4_K/Q5_K's 12 bytes -> eight 6-bit scales and eight 6-bit mins, ``[blocks, 8]``.

    Bytes 0-3 hold scales 0-3 (low 6 bits) and the top 2 bits of scales 4-7; bytes 4-7 the
    same for the mins; bytes 8-11 the low 4 bits of scales 4-7 (low nibble) and of mins
    4-7 (high nibble).
    """
    first, second, low = packed[:, 0:4], packed[:, 4:8], packed[:, 8:12]
    scales = np.concatenate([first & 0x3F, (low & 0x0F) | ((first >> 6) << 4)], axis=-1)
    mins = np.concatenate([second & 0x3F, (low >> 4) | ((second >> 6) << 4)], axis=-1)
    return scales.astype(np.float32), mins.astype(np.float32)


def _k_low_nibbles(qs: np.ndarray) -> np.ndarray:
    """128 bytes -> 256 codes: four 32-byte chunks, each the low nibbles of sub-block 2j
    then the high nibbles of sub-block 2j + 1."""
    chunks = qs.reshape(len(qs), 4, 1, 32) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    return (chunks & 0x0F).reshape(len(qs), 256).astype(np.int16)


def _q4_k(blocks: np.ndarray) -> _Decoded:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    return _Decoded(_k_low_nibbles(blocks[:, 16:144]), d * sc, -dmin * mn, 32, 0, 15)


def _q5_k(blocks: np.ndarray) -> _Decoded:
    d, dmin = _f16(blocks, 0), _f16(blocks, 2)
    sc, mn = _k_scales(blocks[:, 4:16])
    # 32 bytes of fifth bits: bit b of byte i is weight i of sub-block b.
    qh = blocks[:, 16:48]
    high = (qh[:, None, :] >> np.arange(8, dtype=np.uint8)[None, :, None]) & 1
    codes = _k_low_nibbles(blocks[:, 48:176]) | (high.reshape(len(blocks), 256) << 4)
    return _Decoded(codes.astype(np.int16), d * sc, -dmin * mn, 32, 0, 31)


def _q6_k(blocks: np.ndarray) -> _Decoded:
    n = len(blocks)
    ql, qh = blocks[:, 0:128], blocks[:, 128:192]
    sc = blocks[:, 192:208].copy().view(np.int8).astype(np.int16)  # one per 16 weights
    d = _f16(blocks, 208)
    # Two halves of 128 weights. In half h: the low nibbles of ql bytes 64h..64h+63 are
    # weights 0-63 of it, their high nibbles weights 64-127; qh bytes 32h..32h+31 give
    # two more bits to weights i, 32 + i, 64 + i, 96 + i (bit pairs 0, 2, 4, 6).
    shifted = ql.reshape(n, 2, 1, 64) >> np.array([0, 4], np.uint8).reshape(1, 1, 2, 1)
    low = (shifted & 0x0F).reshape(n, 256)
    pairs = qh.reshape(n, 2, 1, 32) >> np.array([0, 2, 4, 6], np.uint8).reshape(1, 1, 4, 1)
    high = (pairs & 0x03).reshape(n, 256)
    q = (low | (high << 4)).astype(np.int16) - 32
    codes = (q.reshape(n, 16, 16) * sc[:, :, None]).reshape(n, 256)
    zeros = np.zeros((n, 1), np.float32)
    # |sc| <= 128 and q - 32 in [-32, 31]: the product lies in [-4064, 4096].
    return _Decoded(codes, d, zeros, 256, -4064, 4096)


_DECODERS = {
    "Q4_0": _q4_0,
    "Q4_1": _q4_1,
    "Q5_0": _q5_0,
    "Q5_1": _q5_1,
    "Q8_0": _q8_0,
    "Q4_K": _q4_k,
    "Q5_K": _q5_k,
    "Q6_K": _q6_k,
}
