"""A real worker's model and runner, built the same way on every tensor-parallel rank.

Rank 0 (``app.build_worker``) and the ranks it spawns (``tp/follower.py``) both load
through here, so every rank picks the same dtype, holds the same KV geometry (its share of
the KV heads, the same number of blocks: the scheduler's block ids index every rank's
cache) and builds the same runner.
"""

from __future__ import annotations

import logging
import time
from typing import Any

import torch

from kvflow.engine_worker.auto_dtype import machine_dtype
from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.model.tensor_parallel import TensorParallel
from kvflow.engine_worker.runner import TorchModelRunner, kv_bytes_per_block
from kvflow.engine_worker.sampler import Sampler
from kvflow.engine_worker.settings import WorkerSettings
from kvflow.engine_worker.tp.leader import rank_device

log = logging.getLogger("kvflow.worker")
GIB = 1024**3


def load_weights_for(
    settings: WorkerSettings, loaded: tuple[Any, Any] | None, *, tp: TensorParallel | None
) -> tuple[LlamaForCausalLM, ModelConfig, torch.dtype]:
    """The model (this rank's slice of it under ``tp``), its config and its dtype.

    ``loaded``: a ``(model, config)`` pair from ``load_model`` to reuse (tests build several
    engines over one model); the engine takes its weights' dtype.
    """
    rank = 0 if tp is None else tp.rank
    device = rank_device(settings.device, rank)
    if loaded is None:
        dtype_name, why = machine_dtype(settings.dtype, settings.device, settings.model)
    else:
        dtype_name, why = str(next(loaded[0].parameters()).dtype).removeprefix("torch."), "loaded"
        if settings.dtype not in ("auto", dtype_name):
            raise ValueError(f"dtype {settings.dtype} asked of a model loaded in {dtype_name}")
    dtype = getattr(torch, dtype_name)
    started = time.monotonic()
    of = "" if tp is None or tp.size == 1 else f", rank {tp.rank} of {tp.size}"
    log.info(
        "loading model %s on %s (%s; %s%s)",
        settings.model or "SmolLM2-135M-Instruct (built-in)",
        device,
        dtype_name,
        why,
        of,
    )
    if loaded is None:
        loaded = load_model(
            settings.model, dtype=dtype, device=device, quantization=settings.quantization, tp=tp
        )
    model, config = loaded
    held = model.weight_bytes() if hasattr(model, "weight_bytes") else {}
    log.info(
        "model %s loaded in %.1f s; weights hold %s",
        config.name,
        time.monotonic() - started,
        ", ".join(f"{n / 2**20:.1f} MiB {kind}" for kind, n in sorted(held.items())) or "?",
    )
    return model, config, dtype


def make_runner(
    settings: WorkerSettings, model: Any, config: ModelConfig, dtype: torch.dtype, *, rank: int
) -> tuple[TorchModelRunner, int, int]:
    """The runner over ``model`` with its KV cache: (runner, KV bytes a block, blocks)."""
    from kvflow.engine_worker.app import num_kv_blocks

    size = settings.tensor_parallel_size if model.tp.size > 1 else 1
    num_kv_heads = config.num_key_value_heads // size
    per_block = kv_bytes_per_block(
        num_layers=config.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=config.head_dim,
        block_size=settings.block_size,
        dtype=dtype,
    )
    num_blocks = num_kv_blocks(settings, per_block)
    device = rank_device(settings.device, rank)
    model_len = config.max_position_embeddings
    runner = TorchModelRunner(
        model,
        num_layers=config.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=config.head_dim,
        num_blocks=num_blocks,
        block_size=settings.block_size,
        dtype=dtype,
        device=device,
        sampler=Sampler(device, default_seed=settings.seed, eos_token_ids=config.eos_token_ids),
        decode_workspace_bytes=int(settings.resolved_decode_workspace_gib() * GIB),
        decode_graph_batch=settings.max_num_seqs if settings.cuda_graphs else 0,
        max_model_len=min(settings.max_model_len or model_len, model_len),
    )
    log.info(
        "KV cache: %d blocks of %d tokens (%.2f GiB%s)",
        num_blocks,
        settings.block_size,
        num_blocks * per_block / GIB,
        f" of {num_kv_heads} KV heads a layer on rank {rank}" if size > 1 else "",
    )
    return runner, per_block, num_blocks
