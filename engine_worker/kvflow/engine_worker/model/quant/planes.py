"""Integer codes of any width as 4-bit planes, the one format torch's int4 kernels multiply.

torch's int4 weight-only kernels (``_weight_int4pack_mm_for_cpu``, and tinygemm's
``_weight_int4pack_mm`` on CUDA) compute ``x @ W.T`` for ``W[n, k] = (c - 8) * s + z``:
``c`` a 4-bit code, ``s`` and ``z`` bf16 and shared by a group of 32 to 256 weights of a row.
A wider code (Q8_0's 8 bits, Q5's 5, Q6_K's 13) is a sum of 4-bit planes,
``t = sum_p 16**p * n_p``, and ``x @ W.T`` is then one call over the planes laid side by
side along K with ``x`` repeated once per plane: the same bytes a wider kernel would read
(8 bits a weight for 2 planes), and exact, with no weight ever widened to float.

How each plane maps to the kernel's ``(c - 8) * s + z``:
- the top plane holds ``t >> 4 (P - 1)``, a signed nibble in [-8, 7], stored as ``c = n + 8``
  with ``z = 0``;
- lower planes hold unsigned nibbles ``(t >> 4p) & 15`` with ``z = 8 s``;
- ``t = code - bias`` (bias centres the code range), and the group's
  ``bias * scale + offset`` joins the zero of plane 0.

Every zero but plane 0's is 0 or 8 times its own scale, a power of two times it, so bf16
holds it as exactly as the scale. Rounding a scale or plane 0's zero to bf16 moves a weight
by at most 2**-9 of the group's largest magnitude, under 1/16 of a 4-bit step.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from kvflow.engine_worker.model.quant.gguf_codes import GroupedCodes

#: The kernels' group sizes (torch checks K % group == 0 for each of these).
KERNEL_GROUP_SIZES = (32, 64, 128, 256)


@dataclass(frozen=True)
class Int4Planes:
    """``W [rows, cols]`` as ``num_planes`` 4-bit planes side by side: ``codes [rows,
    num_planes * cols]`` (uint8, 0..15), with a scale and a zero per group of
    ``group_size`` codes (float32 here; the kernels take bf16). Row ``n``:
    ``W[n, k] = sum_p (codes[n, p * cols + k] - 8) * scales[n, g(p, k)] + zeros[n, g(p, k)]``."""

    codes: np.ndarray  # [rows, num_planes * cols] uint8
    scales: np.ndarray  # [rows, num_planes * cols / group_size] float32
    zeros: np.ndarray  # [rows, num_planes * cols / group_size] float32
    group_size: int
    num_planes: int

    @property
    def rows(self) -> int:
        return int(self.codes.shape[0])

    @property
    def cols(self) -> int:
        return int(self.codes.shape[1]) // self.num_planes

    @property
    def format(self) -> tuple[int, int]:
        """Planes that can share one kernel call have the same (planes, group size)."""
        return self.num_planes, self.group_size

    def dequantize(self) -> np.ndarray:
        """``W`` in float32 (tests, and the reference of the kernels' results)."""
        grouped = self.codes.reshape(self.rows, -1, self.group_size).astype(np.float32)
        planes: np.ndarray = (grouped - 8) * self.scales[..., None] + self.zeros[..., None]
        summed: np.ndarray = planes.reshape(self.rows, self.num_planes, self.cols).sum(axis=1)
        return summed

    def take_rows(self, rows: np.ndarray | slice) -> Int4Planes:
        return Int4Planes(
            self.codes[rows], self.scales[rows], self.zeros[rows], self.group_size, self.num_planes
        )


def num_planes_for(min_code: int, max_code: int) -> tuple[int, int]:
    """(planes, bias) for codes in ``[min_code, max_code]``: the fewest 4-bit planes whose
    top plane, a signed nibble, holds ``(code - bias) >> 4 (P - 1)``."""
    bias = (min_code + max_code + 1) // 2
    low, high = min_code - bias, max_code - bias
    planes = 1
    while not (low >> 4 * (planes - 1) >= -8 and high >> 4 * (planes - 1) <= 7):
        planes += 1
    return planes, bias


def to_planes(grouped: GroupedCodes, group_size: int | None = None) -> Int4Planes:
    """The planes of ``grouped`` with groups of ``group_size`` (default: its own; a smaller
    group than the codes' repeats their scales, e.g. to match a neighbour's format)."""
    group = group_size or grouped.group_size
    assert group in KERNEL_GROUP_SIZES and grouped.group_size % group == 0, (group, grouped)
    rows, cols = grouped.shape
    planes, bias = num_planes_for(grouped.min_code, grouped.max_code)
    repeat = grouped.group_size // group
    scale = np.repeat(grouped.scales, repeat, axis=1)  # [rows, cols / group]
    offset = np.repeat(grouped.offsets, repeat, axis=1)
    shifted = grouped.codes.astype(np.int32) - bias

    codes = np.empty((rows, planes * cols), np.uint8)
    scales = np.empty((rows, planes * cols // group), np.float32)
    zeros = np.empty_like(scales)
    per_plane = cols // group
    for p in range(planes):
        plane_scale = scale * np.float32(16**p)
        nibble = shifted >> 4 * p
        if p == planes - 1:
            codes[:, p * cols : (p + 1) * cols] = nibble + 8  # signed top nibble, zero 0
            plane_zero = np.zeros_like(plane_scale)
        else:
            codes[:, p * cols : (p + 1) * cols] = nibble & 0x0F
            plane_zero = 8 * plane_scale
        if p == 0:
            plane_zero = plane_zero + bias * scale + offset
        scales[:, p * per_plane : (p + 1) * per_plane] = plane_scale
        zeros[:, p * per_plane : (p + 1) * per_plane] = plane_zero
    return Int4Planes(codes, scales, zeros, group, planes)


def stack_rows(parts: list[Int4Planes]) -> Int4Planes:
    """Matrices of one format stacked along rows (a fused projection's parts)."""
    assert len({p.format for p in parts}) == 1 and len({p.cols for p in parts}) == 1
    return Int4Planes(
        np.concatenate([p.codes for p in parts]),
        np.concatenate([p.scales for p in parts]),
        np.concatenate([p.zeros for p in parts]),
        parts[0].group_size,
        parts[0].num_planes,
    )
