"""A weight matrix in FP8 (e4m3), multiplied by ``torch._scaled_mm`` (``--quantization fp8``).

For GPUs with FP8 tensor cores (compute capability 8.9 and up: L4, H100, H200): a bf16
checkpoint's projections are quantized as they load, each output row to e4m3 with a
float32 scale of its own (``amax / 448``, e4m3's largest value), which halves the weights'
bytes and runs the GEMMs at FP8 rate. Each call quantizes the activations the same way,
per row (per token), so one outlier token does not coarsen the others. The product comes
back in bf16. This is the usual W8A8 "dynamic per-token, static per-channel" scheme;
embeddings, norms and the LM head stay in the model's dtype.

torch's CPU ``_scaled_mm`` computes the same (the tests run it), but slower than a bf16
GEMM, so the worker refuses ``--quantization fp8`` off CUDA.
"""

from __future__ import annotations

import torch
from torch import nn

E4M3 = torch.float8_e4m3fn
E4M3_MAX = 448.0
# A row of zeros would get a zero scale and divide by it; this floor keeps it zero.
_MIN_SCALE = 1e-12


def quantize_rows(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` ``[R, C]`` as e4m3 codes and a float32 scale per row ``[R, 1]``:
    ``x ~= codes * scale``."""
    amax = x.abs().amax(dim=-1, keepdim=True).float()
    scale = (amax / E4M3_MAX).clamp(min=_MIN_SCALE)
    codes = (x.float() / scale).clamp(-E4M3_MAX, E4M3_MAX).to(E4M3)
    return codes, scale


class Fp8Weight(nn.Module):
    """``W [rows, cols]`` as e4m3 codes with a float32 scale per row."""

    weight: torch.Tensor
    scale: torch.Tensor

    def __init__(self, weight: torch.Tensor, out_dtype: torch.dtype = torch.bfloat16) -> None:
        super().__init__()
        self.rows, self.cols = weight.shape
        self.out_dtype = out_dtype
        codes, scale = quantize_rows(weight)
        self.register_buffer("weight", codes)  # [rows, cols], row-major
        self.register_buffer("scale", scale.t().contiguous())  # [1, rows]: _scaled_mm's b side

    @property
    def nbytes(self) -> int:
        return self.weight.nbytes + self.scale.nbytes

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        """``x [M, cols] @ W.T`` -> ``[M, rows]`` in ``x``'s dtype."""
        codes, scale = quantize_rows(x)
        out = torch._scaled_mm(
            codes,
            self.weight.t(),  # column-major [cols, rows], as _scaled_mm takes its b
            scale_a=scale,
            scale_b=self.scale,
            out_dtype=self.out_dtype,
        )
        return out.to(x.dtype)

    def dequantize(self) -> torch.Tensor:
        return self.weight.float() * self.scale.t()
