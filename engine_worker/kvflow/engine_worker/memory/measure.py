"""The shell around budget.py: measure the weights and one peak-sized forward, size the KV cache.

``size_kv_cache`` is what ``app.build_worker`` calls once the model is loaded:

- On CUDA with neither ``--kv-cache-gib`` nor ``--num-kv-blocks``, it runs one forward of
  ``--max-num-batched-tokens`` tokens over a temporary cache (``torch.cuda``'s peak
  allocation above the weights is the activations' peak; what the device lost beyond torch's
  own pool is cuBLAS and the like), estimates the CUDA-graph pool, and gives the rest of
  ``--gpu-memory-utilization`` x the device to the cache (budget.gpu_kv_cache_bytes).
- On the CPU the cache is ``--kv-cache-gib`` (or ``--num-kv-blocks``), and the same forward,
  measured by the process's peak resident memory (``VmHWM``, reset first through
  ``/proc/self/clear_refs``), is checked with the cache and the decode workspace against what
  the machine or the container's cgroup can still give (budget.check_cpu_fit).
"""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from kvflow.engine_worker.memory.budget import (
    GIB,
    GpuMeasurement,
    GpuNeeds,
    check_cpu_fit,
    cuda_graph_pool_bytes,
    gather_bytes_per_kv_byte,
    gpu_kv_cache_bytes,
    num_blocks_for,
)
from kvflow.engine_worker.memory.host import host_memory
from kvflow.engine_worker.memory.report import MemoryReport
from kvflow.engine_worker.memory.weight_memory import weight_memory
from kvflow.engine_worker.model.attention import compute_dtype
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.decode_graphs import MAX_PADDED_TOKENS, bucket
from kvflow.engine_worker.model.kv_quant import layout_name, row_width
from kvflow.engine_worker.model.paged_cache import kv_cache_shape
from kvflow.engine_worker.settings import DEFAULT_CPU_KV_CACHE_GIB

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class KvSizing:
    """What sizing the cache takes from the worker's settings."""

    device: str
    model_dtype: torch.dtype
    kv_dtype: torch.dtype
    num_kv_heads: int  # of this rank: a tensor-parallel rank holds a share of the heads
    block_size: int
    bytes_per_block: int  # runner.kv_bytes_per_block
    kv_cache_gib: float | None  # None: sized by utilization on CUDA, 1 GiB on CPU
    num_kv_blocks: int | None
    gpu_memory_utilization: float
    max_num_batched_tokens: int
    max_num_seqs: int
    max_model_len: int
    decode_workspace_bytes: int
    cuda_graphs: bool


def size_kv_cache(model: Any, config: Any, s: KvSizing) -> MemoryReport:
    """The cache's block count for these settings, and what the worker holds; raises
    budget.MemoryBudgetError when it does not fit."""
    weights = weight_memory(model)
    per_block = s.bytes_per_block
    device = torch.device(s.device)
    if device.type == "cuda" and s.kv_cache_gib is None and s.num_kv_blocks is None:
        measured = measure_gpu(model, config, s, sum(weights.values()))
        needs = gpu_needs(config, s)
        kv_bytes = gpu_kv_cache_bytes(measured, needs, utilization=s.gpu_memory_utilization)
        num_blocks = num_blocks_for(kv_bytes, per_block, flag="--gpu-memory-utilization")
        how = (
            f"--gpu-memory-utilization {s.gpu_memory_utilization:g} of "
            f"{measured.total_bytes / GIB:.1f} GiB; peak activations "
            f"{measured.activation_peak_bytes / GIB:.2f} GiB"
        )
    elif s.num_kv_blocks is not None:
        num_blocks, how = s.num_kv_blocks, "--num-kv-blocks"
    else:
        gib = DEFAULT_CPU_KV_CACHE_GIB if s.kv_cache_gib is None else s.kv_cache_gib
        num_blocks = num_blocks_for(int(gib * GIB), per_block, flag=f"--kv-cache-gib {gib:g}")
        how = f"--kv-cache-gib {gib:g}"
    if device.type == "cpu":
        peak = profile_forward(model, config, s)
        check_cpu_fit(
            host_memory(),
            weight_bytes=sum(weights.values()),
            activation_peak_bytes=peak,
            kv_cache_bytes=num_blocks * per_block,
            decode_workspace_bytes=s.decode_workspace_bytes,
        )
        how += f"; peak activations {peak / GIB:.2f} GiB"
    return MemoryReport(
        weight_bytes=weights,
        kv_cache_dtype=layout_name(s.kv_dtype),
        kv_cache_bytes=num_blocks * per_block,
        num_blocks=num_blocks,
        block_size=s.block_size,
        how=how,
    )


def gpu_needs(config: Any, s: KvSizing) -> GpuNeeds:
    """The graph pool's estimate and the gather's share, from the model's shape."""
    device = torch.device(s.device)
    wide = compute_dtype(s.model_dtype, device)
    wide_bytes = torch.empty((), dtype=wide).element_size()
    kv_bytes = torch.empty((), dtype=s.kv_dtype).element_size()
    stored = 2 * s.num_kv_heads * row_width(config.head_dim, s.kv_dtype) * kv_bytes
    read = 2 * s.num_kv_heads * config.head_dim * wide_bytes
    graphs = 0
    if s.cuda_graphs:
        max_blocks = bucket(-(-s.max_model_len // s.block_size))
        max_batch = bucket(s.max_num_seqs)
        graphs = cuda_graph_pool_bytes(
            max_padded_tokens=min(MAX_PADDED_TOKENS, max_batch * max_blocks * s.block_size),
            gather_bytes_per_token=stored + read,
            batch_buckets=[1 << i for i in range(max_batch.bit_length())],
            num_table_buckets=max_blocks.bit_length(),
            vocab_size=config.vocab_size,
            activation_bytes_per_row=wide_bytes
            * (4 * config.hidden_size + 3 * config.intermediate_size),
        )
    return GpuNeeds(
        cuda_graph_bytes=graphs,
        decode_workspace_bytes=s.decode_workspace_bytes,
        gather_bytes_per_kv_byte=gather_bytes_per_kv_byte(
            num_layers=config.num_hidden_layers,
            stored_bytes_per_token=stored,
            read_bytes_per_token=read,
        ),
    )


def measure_gpu(model: Any, config: Any, s: KvSizing, weight_bytes: int) -> GpuMeasurement:
    """The device's memory around one peak-sized forward (weights already loaded)."""
    device = torch.device(s.device)
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    non_torch_before = total - free - torch.cuda.memory_reserved(device)
    torch.cuda.reset_peak_memory_stats(device)
    before = torch.cuda.memory_allocated(device)
    _peak_forward(model, config, s)
    torch.cuda.synchronize(device)
    peak = torch.cuda.max_memory_allocated(device) - before
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    return GpuMeasurement(
        total_bytes=total,
        free_bytes=free,
        torch_reserved_bytes=reserved,
        weight_bytes=weight_bytes,
        activation_peak_bytes=peak,
        non_torch_bytes=max(0, total - free - reserved - non_torch_before),
    )


def profile_forward(model: Any, config: Any, s: KvSizing) -> int:
    """Peak bytes above the resident set during one peak-sized forward on the CPU."""
    is_reset = _reset_peak_rss()
    before = _status_bytes("VmRSS")
    _peak_forward(model, config, s)
    peak = max(0, _status_bytes("VmHWM") - before)
    if not is_reset:
        # The high-water mark may be the loader's, not the forward's: an overestimate.
        log.warning("could not reset the peak RSS: peak activations counted as %d bytes", peak)
    return peak


@torch.inference_mode()
def _peak_forward(model: Any, config: Any, s: KvSizing) -> None:
    """``max_num_batched_tokens`` tokens as fresh prefills (sequences of at most
    ``max_model_len``) over a cache just big enough, and logits for up to ``max_num_seqs``
    rows: the largest step the scheduler may hand the runner."""
    device = torch.device(s.device)
    lens = [s.max_model_len] * (s.max_num_batched_tokens // s.max_model_len)
    if s.max_num_batched_tokens % s.max_model_len:
        lens.append(s.max_num_batched_tokens % s.max_model_len)
    tables, first = [], 0
    for n in lens:
        count = -(-n // s.block_size)
        tables.append(list(range(first, first + count)))
        first += count
    shape = kv_cache_shape(
        num_blocks=first,
        block_size=s.block_size,
        num_kv_heads=s.num_kv_heads,
        head_dim=config.head_dim,
        dtype=s.kv_dtype,
    )
    caches = [
        torch.zeros(shape, dtype=s.kv_dtype, device=device) for _ in range(config.num_hidden_layers)
    ]
    meta = AttentionMetadata.build(
        query_lens=lens,
        context_lens=lens,
        block_tables=tables,
        block_size=s.block_size,
        device=device,
    )
    total = sum(lens)
    ids = torch.arange(total, device=device) % config.vocab_size
    positions = torch.cat([torch.arange(n, device=device) for n in lens])
    hidden = model(ids, positions, caches, meta)
    rows = min(s.max_num_seqs, total)
    model.compute_logits(hidden[total - rows :])


def _reset_peak_rss() -> bool:
    """Reset VmHWM to the current RSS (Linux 4.0+: writing 5 to /proc/self/clear_refs)."""
    try:
        Path("/proc/self/clear_refs").write_text("5")
    except OSError:
        return False
    return True


def _status_bytes(key: str) -> int:
    text = Path("/proc/self/status").read_text()
    match = re.search(rf"^{key}:\s+(\d+) kB", text, re.MULTILINE)
    assert match, key
    return int(match.group(1)) * 1024
