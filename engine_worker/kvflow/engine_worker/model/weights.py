"""Which checkpoint tensors fill which of our parameters, and the filling itself.

Checkpoints name tensors the Hugging Face way (``model.layers.0.self_attn.q_proj.weight``);
the GGUF reader renames its tensors to match, so this is the one place that knows both
sides. Our fused parameters are the checkpoint's tensors stacked along dim 0: ``qkv_proj``
is q, k, v and ``gate_up_proj`` is gate, up. Every shape is checked against the config
before a byte is copied, so a checkpoint that disagrees with its config fails by name.

Under tensor parallelism a rank takes a slice of each split tensor (``CheckpointTensor``'s
``rows`` or ``cols``, from ``shard.py``'s rules): of a quantized matrix too, whose columns
split only at its groups' edges.

A matrix still in a GGUF's quantized blocks (``QuantizedTensor``) becomes 4-bit planes
(``quant/planes.py``) held by its ``Linear`` or ``Embedding`` as ``Int4Weight`` segments:
parts of one format stacked into one segment, a part stored otherwise (or in float) a
segment of its own.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass

import torch
from torch import nn

from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.model.linear import DenseWeight, Embedding, Linear
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.quant.fp8_weight import Fp8Weight
from kvflow.engine_worker.model.quant.gguf_codes import QuantizedTensor
from kvflow.engine_worker.model.quant.int4_weight import Int4Weight
from kvflow.engine_worker.model.quant.planes import Int4Planes, stack_rows, to_planes
from kvflow.engine_worker.model.shard import Shard

#: Tensors some checkpoints carry that we derive instead (RoPE's table).
_DERIVED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclass(frozen=True)
class CheckpointTensor:
    """A checkpoint tensor (``shape``: as the checkpoint holds it) and the slice of it this
    rank takes: ``rows`` and ``cols`` as ``(start, stop)``, None for all."""

    name: str
    shape: tuple[int, ...]
    rows: tuple[int, int] | None = None
    cols: tuple[int, int] | None = None

    @property
    def num_rows(self) -> int:
        return self.shape[0] if self.rows is None else self.rows[1] - self.rows[0]


def checkpoint_layout(
    config: ModelConfig, shard: Shard | None = None
) -> dict[str, tuple[CheckpointTensor, ...]]:
    """Our parameter name -> the checkpoint tensors (slices of them, for a tensor-parallel
    ``shard``) stacked along dim 0 to make it."""
    shard = shard or Shard()
    hidden, ffn = config.hidden_size, config.intermediate_size
    q_rows = config.num_attention_heads * config.head_dim
    kv_rows = config.num_key_value_heads * config.head_dim
    vocab = shard.part(config.vocab_size)

    def one(
        name: str, *shape: int, rows: tuple[int, int] | None = None
    ) -> tuple[CheckpointTensor, ...]:
        return (CheckpointTensor(name, shape, rows=rows),)

    layout = {
        "embed_tokens.weight": one(
            "model.embed_tokens.weight", config.vocab_size, hidden, rows=vocab
        ),
        "norm.weight": one("model.norm.weight", hidden),
    }
    if not config.tie_word_embeddings:
        layout["lm_head.weight"] = one("lm_head.weight", config.vocab_size, hidden, rows=vocab)

    def column_parallel(ours: str, theirs: list[tuple[str, int]], cols: int, bias: bool) -> None:
        """Each rank: its slice of every part's rows (its heads, its share of the MLP)."""
        layout[f"{ours}.weight"] = tuple(
            CheckpointTensor(f"{name}.weight", (rows, cols), rows=shard.part(rows))
            for name, rows in theirs
        )
        if bias:
            layout[f"{ours}.bias"] = tuple(
                CheckpointTensor(f"{name}.bias", (rows,), rows=shard.part(rows))
                for name, rows in theirs
            )

    def row_parallel(ours: str, theirs: str, rows: int, cols: int, bias: bool) -> None:
        """Each rank: its slice of the columns; the bias on rank 0 (the sum adds it once)."""
        layout[f"{ours}.weight"] = (
            CheckpointTensor(f"{theirs}.weight", (rows, cols), cols=shard.part(cols)),
        )
        if bias and shard.rank == 0:
            layout[f"{ours}.bias"] = (CheckpointTensor(f"{theirs}.bias", (rows,)),)

    for i in range(config.num_hidden_layers):
        ours, theirs = f"layers.{i}", f"model.layers.{i}"
        attn, mlp = f"{theirs}.self_attn", f"{theirs}.mlp"
        layout[f"{ours}.input_layernorm.weight"] = one(f"{theirs}.input_layernorm.weight", hidden)
        layout[f"{ours}.post_attention_layernorm.weight"] = one(
            f"{theirs}.post_attention_layernorm.weight", hidden
        )
        qkv = [(f"{attn}.q_proj", q_rows), (f"{attn}.k_proj", kv_rows), (f"{attn}.v_proj", kv_rows)]
        column_parallel(f"{ours}.self_attn.qkv_proj", qkv, hidden, config.qkv_bias)
        row_parallel(f"{ours}.self_attn.o_proj", f"{attn}.o_proj", hidden, q_rows, config.o_bias)
        gate_up = [(f"{mlp}.gate_proj", ffn), (f"{mlp}.up_proj", ffn)]
        column_parallel(f"{ours}.mlp.gate_up_proj", gate_up, hidden, config.mlp_bias)
        row_parallel(f"{ours}.mlp.down_proj", f"{mlp}.down_proj", hidden, ffn, config.mlp_bias)
    return layout


def _take(tensor: torch.Tensor, part: CheckpointTensor) -> torch.Tensor:
    if part.rows is not None:
        tensor = tensor[part.rows[0] : part.rows[1]]
    if part.cols is not None:
        tensor = tensor[:, part.cols[0] : part.cols[1]]
    return tensor


def load_weights(
    model: LlamaForCausalLM,
    tensors: Mapping[str, torch.Tensor | QuantizedTensor],
    *,
    source: str,
    describe: Mapping[str, str] | None = None,
    fp8: bool = False,
) -> None:
    """Copy ``tensors`` (checkpoint names; read lazily, one at a time) into ``model``.

    ``source`` names the folder or file in errors; ``describe`` optionally maps a
    checkpoint name to how the user's file spells it (a GGUF tensor name). Quantized
    tensors stay quantized (see the module docstring); with ``fp8`` the float projections
    (attention and MLP, not the embedding or the LM head) become FP8 as they load.
    """
    config = model.config
    shard = Shard(model.tp.rank, model.tp.size)
    layout = checkpoint_layout(config, shard)
    params = dict(model.named_parameters())
    assert set(params) == set(layout), set(params) ^ set(layout)
    modules = dict(model.named_modules())

    def shown(name: str) -> str:
        original = (describe or {}).get(name)
        return f"'{name}'" + (f" (GGUF '{original}')" if original else "")

    # Against the whole model's tensors: a rank's layout leaves out what other ranks take.
    _reject_unknown(tensors, checkpoint_layout(config), config, source)
    with torch.no_grad():
        for param_name, parts in layout.items():
            param, row = params[param_name], 0
            sources: list[torch.Tensor | QuantizedTensor] = []
            for part in parts:
                if part.name not in tensors:
                    raise ModelLoadError(
                        f"{source}: tensor {shown(part.name)} is missing; config.json "
                        f"describes a {config.architecture} that needs it"
                    )
                tensor = tensors[part.name]
                if tuple(tensor.shape) != part.shape:
                    raise ModelLoadError(
                        f"{source}: tensor {shown(part.name)} has shape {tuple(tensor.shape)}, "
                        f"but the config implies {part.shape} (hidden_size="
                        f"{config.hidden_size}, heads={config.num_attention_heads}/"
                        f"{config.num_key_value_heads}, head_dim={config.head_dim}, "
                        f"intermediate_size={config.intermediate_size}, "
                        f"vocab_size={config.vocab_size})"
                    )
                sources.append(tensor)
            owner_name = param_name.rsplit(".", 1)[0]
            is_projection = owner_name.startswith("layers.") and param_name.endswith(".weight")
            if fp8 and is_projection and "layernorm" not in param_name:
                _to_fp8(modules[owner_name], parts, sources, param, source, shown)
                continue
            if any(isinstance(t, QuantizedTensor) for t in sources):
                _quantize(
                    modules[owner_name], parts, sources, param, keep_rows=owner_name == "lm_head"
                )
                continue
            for part, tensor in zip(parts, sources, strict=True):
                assert isinstance(tensor, torch.Tensor)
                # Into the parameter's rows directly: no stacked temporary to allocate.
                param[row : row + part.num_rows].copy_(_take(tensor, part))
                row += part.num_rows
            assert row == param.shape[0], (param_name, row, param.shape)


def _quantize(
    owner: nn.Module,
    parts: tuple[CheckpointTensor, ...],
    sources: list[torch.Tensor | QuantizedTensor],
    param: torch.Tensor,
    *,
    keep_rows: bool,
) -> None:
    """Give ``owner`` (a ``Linear`` or ``Embedding``) its weight as quantized segments;
    ``keep_rows``: its rows are read too (an LM head's refined logits)."""
    device = param.device
    pieces: list[Int4Planes | torch.Tensor] = [
        to_planes(t.codes().take(part.rows, part.cols))
        if isinstance(t, QuantizedTensor)
        else _take(t, part).to(param.dtype)
        for part, t in zip(parts, sources, strict=True)
    ]
    if isinstance(owner, Embedding):
        (planes,) = pieces
        assert isinstance(planes, Int4Planes)
        weight = Int4Weight(planes, device)
        weight.keep_rows(planes)  # an embedding reads rows; on CUDA from a plain copy
        owner.quantize(weight)
        return
    assert isinstance(owner, Linear), type(owner)
    segments: list[Int4Weight | DenseWeight] = []
    for run in _runs(pieces):
        first = run[0]
        if isinstance(first, Int4Planes):
            same = [p for p in run if isinstance(p, Int4Planes)]
            stacked = stack_rows(same) if len(same) > 1 else same[0]
            segment = Int4Weight(stacked, device)
            if keep_rows:
                segment.keep_rows(stacked)
            segments.append(segment)
        else:
            dense = torch.cat([t for t in run if isinstance(t, torch.Tensor)])
            segments.append(DenseWeight(dense.to(device)))
    owner.quantize(segments)


def _to_fp8(
    owner: nn.Module,
    parts: tuple[CheckpointTensor, ...],
    sources: list[torch.Tensor | QuantizedTensor],
    param: torch.Tensor,
    source: str,
    shown: Callable[[str], str],
) -> None:
    """A float projection's parts, stacked, as one FP8 segment (``quant/fp8_weight.py``)."""
    dense = []
    for part, tensor in zip(parts, sources, strict=True):
        if isinstance(tensor, QuantizedTensor):
            raise ModelLoadError(
                f"{source}: tensor {shown(part.name)} is already quantized ({tensor.type_name}); "
                "--quantization fp8 quantizes a float checkpoint: drop it for a GGUF"
            )
        dense.append(_take(tensor, part).to(device=param.device, dtype=param.dtype))
    assert isinstance(owner, Linear), type(owner)
    owner.quantize([Fp8Weight(torch.cat(dense), out_dtype=torch.bfloat16)])


def _runs(pieces: list[Int4Planes | torch.Tensor]) -> list[list[Int4Planes | torch.Tensor]]:
    """Consecutive pieces that can share one segment: planes of one format, or floats."""
    runs: list[list[Int4Planes | torch.Tensor]] = []
    for piece in pieces:
        key = piece.format if isinstance(piece, Int4Planes) else "dense"
        last = runs[-1][-1] if runs else None
        last_key = (
            None if last is None else last.format if isinstance(last, Int4Planes) else "dense"
        )
        if runs and key == last_key:
            runs[-1].append(piece)
        else:
            runs.append([piece])
    return runs


def _reject_unknown(
    tensors: Mapping[str, torch.Tensor | QuantizedTensor],
    layout: dict[str, tuple[CheckpointTensor, ...]],
    config: ModelConfig,
    source: str,
) -> None:
    """A tensor we would ignore means a layer we do not implement (a QK-norm, experts)."""
    expected = {part.name for parts in layout.values() for part in parts}
    if config.tie_word_embeddings:
        expected.add("lm_head.weight")  # some tied checkpoints store the copy anyway
    unknown = sorted(n for n in tensors if n not in expected and not n.endswith(_DERIVED_SUFFIXES))
    if unknown:
        names = ", ".join(unknown[:5]) + (
            f" and {len(unknown) - 5} more" if len(unknown) > 5 else ""
        )
        raise ModelLoadError(
            f"{source}: tensors {names} have no place in a {config.architecture} with this "
            "config; the checkpoint has layers kvflow does not implement"
        )
