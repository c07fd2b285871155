"""The Llama-family decoder (Llama 2/3, Mistral, Qwen2) over a paged KV cache.

One forward pass takes the new tokens of every scheduled sequence flattened into one row
per token (``AttentionMetadata`` says which rows belong together and where their context
lives), so prefill chunks and decodes of many requests share every matrix multiply.

Q, K and V come from one fused projection and the MLP's gate and up from another: fewer,
larger matmuls. ``weights.py`` maps a checkpoint's separate tensors onto them.

Under tensor parallelism (``tensor_parallel.py``, ``shard.py``) each rank builds the same
model with its slice of every dimension that splits: its heads, its share of the MLP, its
share of the vocabulary. Partial results meet in three sums a layer can need (after the
attention output and the down projection; the embedding's) and one gather of the logits.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from kvflow.engine_worker.model import elementwise
from kvflow.engine_worker.model.attention import paged_attention
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.linear import Embedding, Linear, head_logits
from kvflow.engine_worker.model.rope import RotaryEmbedding, Rotation
from kvflow.engine_worker.model.shard import Shard
from kvflow.engine_worker.model.tensor_parallel import SingleRank, TensorParallel


class RMSNorm(nn.Module):
    """Scale each row to unit root-mean-square, then by a learned per-channel weight."""

    eps_tensor: torch.Tensor

    def __init__(self, size: int, eps: float, dtype: torch.dtype, device: torch.device) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(size, dtype=dtype, device=device))
        self.eps = eps
        # eps as a tensor, so eps + |x|^2 / n is one addcmul; not persistent: not a weight.
        self.register_buffer(
            "eps_tensor", torch.tensor(eps, dtype=torch.float32, device=device), persistent=False
        )

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        # A decode step's few rows: one C call (elementwise.py), where torch runs five ops
        # (seven in bf16).
        normed = elementwise.rms_norm(x, self.weight, self.eps)
        if normed is not None:
            return normed
        if x.dtype == torch.float32:
            # mean(x^2) as |x|^2 / n: one reduction kernel where F.rms_norm, a composite on
            # the CPU, runs six; each small op costs 10-20 us at batch 1 (DecoderLayer).
            norm = torch.linalg.vector_norm(x, dim=-1, keepdim=True)
            mean_square = torch.addcmul(self.eps_tensor, norm, norm, value=1.0 / x.shape[-1])
            return (x * mean_square.rsqrt_()).mul_(self.weight)
        # The mean of squares in float32: bf16 keeps under 3 significant digits, and a sum
        # of hundreds of squares in it would drift. The float32 path's one-reduction norm on
        # the widened rows, then the reference's rounding (normed rows to the model's dtype,
        # times the weight in it): 64 x 576 bf16 rows in 42 us against 64 (1 thread).
        x32 = x.float()
        norm = torch.linalg.vector_norm(x32, dim=-1, keepdim=True)
        mean_square = torch.addcmul(self.eps_tensor, norm, norm, value=1.0 / x.shape[-1])
        return x32.mul_(mean_square.rsqrt_()).to(x.dtype).mul_(self.weight)


class Attention(nn.Module):
    """The attention block's weights (this rank's heads); ``DecoderLayer.forward`` runs them."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, shard: Shard
    ) -> None:
        super().__init__()
        self.num_heads = config.num_attention_heads // shard.size
        self.num_kv_heads = config.num_key_value_heads // shard.size
        self.head_dim = config.head_dim
        self.scale = config.head_dim**-0.5
        self.q_size = self.num_heads * self.head_dim
        kv_size = self.num_kv_heads * self.head_dim
        self.qk_size = self.q_size + kv_size
        self.qkv_proj = Linear(
            config.hidden_size,
            self.q_size + 2 * kv_size,
            bias=config.qkv_bias,
            dtype=dtype,
            device=device,
        )
        # Row-parallel: the ranks' products are summed, so rank 0 alone adds the bias.
        o_bias = config.o_bias and shard.rank == 0
        self.o_proj = Linear(
            self.q_size, config.hidden_size, bias=o_bias, dtype=dtype, device=device
        )


class MLP(nn.Module):
    """SwiGLU's weights (this rank's share of the width), ``down(silu(gate(x)) * up(x))``;
    ``DecoderLayer.forward`` runs them."""

    def __init__(
        self, config: ModelConfig, dtype: torch.dtype, device: torch.device, shard: Shard
    ) -> None:
        super().__init__()
        size, hidden = config.intermediate_size // shard.size, config.hidden_size
        self.gate_up_proj = Linear(
            hidden, 2 * size, bias=config.mlp_bias, dtype=dtype, device=device
        )
        down_bias = config.mlp_bias and shard.rank == 0
        self.down_proj = Linear(size, hidden, bias=down_bias, dtype=dtype, device=device)


def _project(x: torch.Tensor, proj: Linear) -> torch.Tensor:
    """``proj(x)`` without the module call (bench/engine_profile.py times the GEMMs here)."""
    return proj.forward(x)


def _add_projected(
    residual: torch.Tensor, x: torch.Tensor, proj: Linear, tp: TensorParallel
) -> torch.Tensor:
    """``residual + proj(x)``; dense, as one ``addmm``: the residual add rides in the GEMM.

    Row-parallel over several ranks: every rank's partial product is summed, rank 0's
    carrying the residual (once) and the bias."""
    if tp.size == 1:
        return proj.add_to(residual, x)
    out = proj.add_to(residual, x) if tp.rank == 0 else proj.forward(x)
    return tp.all_reduce(out)


class DecoderLayer(nn.Module):
    """One transformer block, run as one function over its children's weights.

    At batch 1 a decode step is a few large GEMMs and, per layer, about twenty small ops
    whose caches the GEMMs' weight stream has just flushed: each small op and module call
    costs 10-20 us there, against 2 us warm (bench/engine_roofline.py, docs/benchmarks.md).
    So the children hold weights and are not called: no module call per projection, the
    residual adds fused into the output GEMMs, RoPE written into the QKV output in place,
    and K and V handed to the cache as the one slice of it they already are.
    """

    def __init__(
        self,
        config: ModelConfig,
        dtype: torch.dtype,
        device: torch.device,
        tp: TensorParallel,
    ) -> None:
        super().__init__()
        eps = config.rms_norm_eps
        shard = Shard(tp.rank, tp.size)
        self.tp = tp
        self.input_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.self_attn = Attention(config, dtype, device, shard)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, eps, dtype, device)
        self.mlp = MLP(config, dtype, device, shard)

    def forward(
        self,
        x: torch.Tensor,
        rotation: Rotation,
        kv_cache: torch.Tensor,
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        attn, mlp = self.self_attn, self.mlp
        num_tokens = x.shape[0]
        qkv = _project(self.input_layernorm.forward(x), attn.qkv_proj)
        # Q and K are neighbours in the fused projection: rotate them in one pass, in place.
        qk = qkv[:, : attn.qk_size].view(num_tokens, attn.num_heads + attn.num_kv_heads, -1)
        rotation.apply_(qk)
        q = qkv[:, : attn.q_size].view(num_tokens, attn.num_heads, attn.head_dim)
        # K then V of every head: one token's row of the cache, as it stores them.
        kv = qkv[:, attn.q_size :].view(num_tokens, 2, attn.num_kv_heads, attn.head_dim)
        out = paged_attention(q, kv, kv_cache, meta, attn.scale)
        x = _add_projected(x, out.reshape(num_tokens, -1), attn.o_proj, self.tp)

        gate_up = _project(self.post_attention_layernorm.forward(x), mlp.gate_up_proj)
        gate, up = gate_up.chunk(2, dim=-1)
        return _add_projected(x, F.silu(gate).mul_(up), mlp.down_proj, self.tp)


class LlamaForCausalLM(nn.Module):
    """A decoder whose weights are uninitialised until ``weights.load_weights`` fills them.

    Build it through ``loader.load_model``. Call ``forward`` under ``torch.inference_mode()``.
    """

    def __init__(
        self,
        config: ModelConfig,
        *,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        tp: TensorParallel | None = None,
    ) -> None:
        """``tp``: this rank and its group (None: the whole model on one device)."""
        super().__init__()
        dev = torch.device(device)
        self.config = config
        self.tp = tp or SingleRank()
        self.vocab_start, vocab_stop = Shard(self.tp.rank, self.tp.size).part(config.vocab_size)
        self.vocab_local = vocab_stop - self.vocab_start
        self.embed_tokens = Embedding(self.vocab_local, config.hidden_size, dtype=dtype, device=dev)
        self.layers = nn.ModuleList(
            DecoderLayer(config, dtype, dev, self.tp) for _ in range(config.num_hidden_layers)
        )
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps, dtype, dev)
        self.lm_head: Linear | None = None
        if not config.tie_word_embeddings:
            self.lm_head = Linear(
                config.hidden_size, self.vocab_local, bias=False, dtype=dtype, device=dev
            )
        self.rotary = RotaryEmbedding(config, dev)

    def forward(
        self,
        input_ids: torch.Tensor,
        positions: torch.Tensor,
        kv_caches: list[torch.Tensor],
        meta: AttentionMetadata,
    ) -> torch.Tensor:
        """Final hidden states ``[T, hidden_size]`` of this step's ``T`` new tokens.

        ``input_ids`` and ``positions`` are ``[T]`` int64, in the order ``meta`` lays the
        sequences out. Side effect: every layer writes the new tokens' keys and values into
        its cache, ``kv_caches[i]`` (shaped as ``paged_cache.kv_cache_shape`` says), at
        ``meta.slot_mapping``.
        """
        assert len(kv_caches) == len(self.layers), (
            f"{len(kv_caches)} KV caches for {len(self.layers)} layers"
        )
        x = self._embed(input_ids)
        rotation = self.rotary(positions, x.dtype)
        for i, (layer, kv_cache) in enumerate(zip(self.layers, kv_caches, strict=True)):
            x = layer(x, rotation, kv_cache, meta.layer(i))
        result: torch.Tensor = self.norm(x)
        return result

    def _embed(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp.size == 1:
            rows: torch.Tensor = self.embed_tokens(input_ids)
            return rows
        # This rank holds the rows of its share of the vocabulary; the others' tokens get
        # zeros here and their rows from the rank that has them, in the sum.
        local = input_ids - self.vocab_start
        held = (local >= 0) & (local < self.vocab_local)
        mine: torch.Tensor = self.embed_tokens(torch.where(held, local, torch.zeros_like(local)))
        return self.tp.all_reduce(mine.mul_(held.unsqueeze(-1).to(mine.dtype)))

    def compute_logits(self, hidden: torch.Tensor) -> torch.Tensor | None:
        """Float32 logits ``[N, vocab_size]`` of the rows ``[N, hidden_size]`` to sample from
        (``linear.head_logits`` says how each kind of head computes them). Over several
        ranks each computes its share of the vocabulary and rank 0 gets them all; the other
        ranks get None."""
        head = self.embed_tokens if self.lm_head is None else self.lm_head
        return self.tp.gather_last(head_logits(hidden, head))
