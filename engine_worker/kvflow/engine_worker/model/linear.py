"""The model's matrices: ``Linear`` (``x @ W.T + b``) and ``Embedding`` (rows of ``W``).

Each holds its weight one of two ways, chosen by the loader from the checkpoint:

- **dense**: a float ``weight`` parameter in the model's dtype, multiplied by torch's GEMMs;
- **quantized**: ``segments``, one or more ``Int4Weight`` stacked along the rows. A fused
  projection (Q, K and V; gate and up) whose parts share one format is one segment; parts
  stored differently (a Q4_K_M file keeps V in Q6_K beside Q4_K for Q and K) are one
  segment each, their outputs laid side by side.

``Linear`` is built dense and empty (``torch.empty`` touches no page until written); the
loader either fills ``weight`` or hands it segments, which drops the empty weight.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.engine_worker.model import dense_gemv
from kvflow.engine_worker.model.quant.fp8_weight import Fp8Weight
from kvflow.engine_worker.model.quant.int4_weight import Int4Weight

#: A quantized LM head computes in bf16 (``Int4Weight``), whose logits near 25 are 0.125
#: apart; SmolLM2's first answer token to "What is the capital of France?" is "The" at
#: 25.33 against "L" at 25.24. So the likeliest tokens' logits are recomputed in float32
#: from the same quantized weights: the top ``REFINE_TOP_K`` by the bf16 logits. A rounded
#: logit errs by at most about 0.06 there, so a near-tie for the top is always among them,
#: and at temperature 1 the tokens past the 8th, whose probabilities keep that 6 % error,
#: hold little of the mass. 8 rows a sampled row: 512 rows of the head for a batch of 64,
#: 3 ms a step on one core; 32 rows cost 4x that.
REFINE_TOP_K = 8


def dense_product(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    """``x @ weight.T + bias`` over a dense weight: a bf16 decode step's few rows through
    kvflow's GEMV where it runs (``dense_gemv``), else torch's linear."""
    out = dense_gemv.linear(x, weight, bias)
    return F.linear(x, weight, bias) if out is None else out


class DenseWeight(nn.Module):
    """A float segment among quantized ones (a part the file kept in F16 or F32)."""

    def __init__(self, weight: torch.Tensor) -> None:
        super().__init__()
        self.weight = nn.Parameter(weight, requires_grad=False)
        self.rows, self.cols = weight.shape

    def matmul(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Linear(nn.Module):
    """``x @ W.T + b``, ``W`` ``[out_features, in_features]``, dense or quantized."""

    weight: nn.Parameter | None
    segments: nn.ModuleList | None

    def __init__(
        self,
        in_features: int,
        out_features: int,
        *,
        bias: bool,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.empty(out_features, dtype=dtype, device=device)) if bias else None
        )
        self.segments = None

    def quantize(self, segments: Sequence[Int4Weight | Fp8Weight | DenseWeight]) -> None:
        """Hold ``W`` as these segments (their rows in order) instead of a dense weight."""
        assert sum(s.rows for s in segments) == self.out_features, (
            [s.rows for s in segments],
            self.out_features,
        )
        assert all(s.cols == self.in_features for s in segments)
        self.weight = None
        self.segments = nn.ModuleList(segments)

    @property
    def is_quantized(self) -> bool:
        return self.segments is not None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return dense_product(x, self.weight, self.bias)
        assert self.segments is not None
        parts = [_segment(segment).matmul(x) for segment in self.segments]
        out = parts[0] if len(parts) == 1 else torch.cat(parts, dim=-1)
        return out if self.bias is None else out.add_(self.bias)

    def add_to(self, residual: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
        """``residual + self(x)``; dense, as one ``addmm`` (the add rides in the GEMM), or
        one call of kvflow's GEMV at a bf16 decode step's few rows."""
        if self.weight is None:
            return self.forward(x).add_(residual)
        fused = dense_gemv.linear(x, self.weight, self.bias, residual)
        if fused is not None:
            return fused
        out = torch.addmm(residual, x, self.weight.t())
        return out if self.bias is None else out.add_(self.bias)


class Embedding(nn.Module):
    """Rows of ``W`` ``[num_embeddings, dim]`` by token id; also a tied LM head."""

    weight: nn.Parameter | None
    quantized: Int4Weight | None

    def __init__(
        self, num_embeddings: int, dim: int, *, dtype: torch.dtype, device: torch.device
    ) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(num_embeddings, dim, dtype=dtype, device=device))
        self.dtype = dtype
        self.quantized = None

    def quantize(self, weight: Int4Weight) -> None:
        self.weight = None
        self.quantized = weight

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.weight is not None:
            return F.embedding(ids, self.weight)
        assert self.quantized is not None
        return self.quantized.take_rows(ids).to(self.dtype)


def head_logits(hidden: torch.Tensor, head: Linear | Embedding) -> torch.Tensor:
    """Float32 logits ``[N, vocab]`` of ``hidden`` ``[N, dim]`` through an LM head's ``W``.

    Dense: one product in the model's dtype, widened after (in bf16 that rounds logits to
    about 3 significant digits, as the reference implementation does). Quantized: kvflow's
    GEMV's float32 logits as they are, with float32 activations; otherwise (its int8
    activations, torch's kernel's bf16 ones, a bf16 GEMM's) the likeliest ``REFINE_TOP_K``
    recomputed in float32.
    """
    weight = head.weight
    if weight is not None:
        return dense_product(hidden, weight).float()
    quantized = head.quantized if isinstance(head, Embedding) else _single_segment(head)
    assert quantized is not None
    logits = quantized.matmul(hidden).float()
    sums_f32 = not quantized.int8_activations and hidden.shape[0] < quantized.widen_min_rows()
    if quantized.native and sums_f32:
        return logits  # kvflow's GEMV on float32 activations: nothing to refine
    top = logits.topk(min(REFINE_TOP_K, logits.shape[-1]), dim=-1).indices  # [N, k]
    rows = quantized.take_rows(top.reshape(-1)).view(*top.shape, -1)  # [N, k, dim] float32
    exact = torch.bmm(rows, hidden.float().unsqueeze(-1)).squeeze(-1)
    return logits.scatter_(1, top, exact)


def _segment(module: nn.Module) -> Int4Weight | Fp8Weight | DenseWeight:
    assert isinstance(module, Int4Weight | Fp8Weight | DenseWeight), type(module)
    return module


def _single_segment(head: Linear) -> Int4Weight | None:
    assert head.segments is not None and len(head.segments) == 1, "an LM head is one tensor"
    segment = head.segments[0]
    assert isinstance(segment, Int4Weight)
    return segment
