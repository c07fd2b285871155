"""A real worker's model and runner, built the same way on every tensor-parallel rank.

Rank 0 (``app.build_worker``) and the ranks it spawns (``tp/follower.py``) both load
through here, so every rank picks the same dtype, holds the same KV geometry (its share of
the KV heads, the same number of blocks: the scheduler's block ids index every rank's
cache) and builds the same runner.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import Any

import torch

from kvflow.engine_worker.auto_dtype import machine_dtype
from kvflow.engine_worker.memory.budget import MemoryBudgetError
from kvflow.engine_worker.memory.measure import KvSizing, size_kv_cache
from kvflow.engine_worker.memory.report import MemoryReport
from kvflow.engine_worker.model.attention import compute_dtype
from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.kv_quant import (
    KvCacheDtypeError,
    check_device_supports,
    kv_cache_dtype,
)
from kvflow.engine_worker.model.llama import LlamaForCausalLM
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.model.paged_kernel import uses_paged_kernel
from kvflow.engine_worker.model.tensor_parallel import TensorParallel
from kvflow.engine_worker.runner import TorchModelRunner, kv_bytes_per_block, kv_layout
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
    log.info("model %s loaded in %.1f s", config.name, time.monotonic() - started)
    return model, config, dtype


@dataclass(frozen=True)
class TorchRunner:
    runner: TorchModelRunner
    num_blocks: int  # the same on every rank
    memory: MemoryReport  # this rank's
    whole_kv_layout: str  # a block with every KV head: what PD peers exchange


def make_runner(
    settings: WorkerSettings, model: Any, config: ModelConfig, dtype: torch.dtype, *, rank: int
) -> TorchRunner:
    """The runner over ``model`` with its KV cache, sized as ``memory/`` says (this rank's
    share of the KV heads, on its own device); ranks agree on the fewest blocks any fits."""
    size = model.tp.size
    device = rank_device(settings.device, rank)
    try:
        kv_dtype = kv_cache_dtype(settings.kv_cache_dtype, dtype)
        check_device_supports(kv_dtype, device)
    except KvCacheDtypeError as exc:
        raise SystemExit(str(exc)) from None
    num_kv_heads = config.num_key_value_heads // size
    per_block = kv_bytes_per_block(
        num_layers=config.num_hidden_layers,
        num_kv_heads=num_kv_heads,
        head_dim=config.head_dim,
        block_size=settings.block_size,
        dtype=kv_dtype,
    )
    paged = settings.paged_attention and uses_paged_kernel(
        torch.device(device),
        settings.block_size,
        kv_dtype,
        compute_dtype(dtype, torch.device(device)),
    )
    # Where decodes read the cache in place, dense copies of it would only cost memory.
    workspace_bytes = 0 if paged else int(settings.resolved_decode_workspace_gib() * GIB)
    model_len = config.max_position_embeddings
    max_len = min(settings.max_model_len or model_len, model_len)
    sizing = KvSizing(
        device=device,
        model_dtype=dtype,
        kv_dtype=kv_dtype,
        num_kv_heads=num_kv_heads,
        block_size=settings.block_size,
        bytes_per_block=per_block,
        kv_cache_gib=settings.kv_cache_gib,
        num_kv_blocks=settings.num_kv_blocks,
        gpu_memory_utilization=settings.gpu_memory_utilization,
        max_num_batched_tokens=settings.max_num_batched_tokens,
        max_num_seqs=settings.max_num_seqs,
        max_model_len=max_len,
        decode_workspace_bytes=workspace_bytes,
        cuda_graphs=settings.cuda_graphs,
    )
    try:
        memory = size_kv_cache(model, config, sizing)  # every rank runs its peak forward
    except MemoryBudgetError as exc:
        raise SystemExit(str(exc)) from None
    # Block ids index every rank's cache: all take the fewest that any rank's device holds.
    num_blocks = model.tp.min_int(memory.num_blocks)
    if num_blocks != memory.num_blocks:
        memory = replace(
            memory,
            num_blocks=num_blocks,
            kv_cache_bytes=num_blocks * per_block,
            how=f"{memory.how}; the fewest blocks of {size} ranks",
        )
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
        decode_workspace_bytes=workspace_bytes,
        decode_graph_batch=settings.max_num_seqs if settings.cuda_graphs else 0,
        max_model_len=max_len,
        kv_cache_dtype=kv_dtype,
        paged_kernel=paged,
    )
    whole = kv_layout(
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        block_size=settings.block_size,
        kv_dtype=kv_dtype,
    )
    if size > 1:
        log.info("rank %d of %d holds %d of %d KV heads a layer", rank, size, num_kv_heads,
                 config.num_key_value_heads)  # fmt: skip
    return TorchRunner(runner, num_blocks, memory, whole)
