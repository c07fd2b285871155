"""How much memory the KV cache gets, and whether a worker fits: arithmetic over measured bytes.

Pure (no torch, no I/O): ``measure.py`` measures, this module decides, so every rule here is
tested over plain numbers.

On a GPU the cache takes what is left of ``--gpu-memory-utilization`` x the device's memory
once the worker's other needs are counted (vLLM's convention): the weights, the peak of one
forward of ``--max-num-batched-tokens`` tokens, memory that forward made outside torch's
allocator (cuBLAS workspaces), the CUDA-graph pool with ``--cuda-graphs``, the decode
workspace if one is asked for, and the transient copy a decode step's gather makes of one
layer's cache (``gather_bytes_per_kv_byte``). Memory other processes hold, and the CUDA
context this process made before anything was measured, lie outside the budget, as in vLLM.

On the CPU ``--kv-cache-gib`` stays the cache's size; the same needs are checked against
what the machine, or the container's cgroup limit, can still give.
"""

from __future__ import annotations

from dataclasses import dataclass

GIB = 1024**3


class MemoryBudgetError(ValueError):
    """The worker does not fit in its memory; the message names the flags to change."""


@dataclass(frozen=True)
class GpuMeasurement:
    """What the GPU shell measured after loading the weights and one peak-sized forward."""

    total_bytes: int  # the device's memory
    free_bytes: int  # free on the device now, torch's cached blocks released
    torch_reserved_bytes: int  # what torch's allocator holds now (the weights, mostly)
    weight_bytes: int
    activation_peak_bytes: int  # allocated above the weights during the forward, at its peak
    non_torch_bytes: int  # device memory the forward took outside torch's allocator


@dataclass(frozen=True)
class GpuNeeds:
    """What the worker will take beside the KV cache, as configured."""

    cuda_graph_bytes: int = 0  # an estimate (cuda_graph_pool_bytes); 0 without --cuda-graphs
    decode_workspace_bytes: int = 0  # --decode-workspace-gib (0, off, on CUDA by default)
    # Bytes a decode step's gather copies per byte of cache: one layer's worth, at most
    # (every decoding sequence's context of that layer, padded and dequantized; freed
    # before the next layer). See measure.gather_bytes_per_kv_byte.
    gather_bytes_per_kv_byte: float = 0.0


def gpu_kv_cache_bytes(m: GpuMeasurement, needs: GpuNeeds, *, utilization: float) -> int:
    """The KV cache's bytes under ``utilization`` x the device's memory.

    Raises MemoryBudgetError when other processes already hold more than the budget leaves,
    or when nothing is left for the cache."""
    if not 0.0 < utilization <= 1.0:
        raise MemoryBudgetError(
            f"--gpu-memory-utilization {utilization:g} must lie in (0, 1]: the fraction of "
            "the device's memory this worker may use"
        )
    budget = int(utilization * m.total_bytes)
    # What this process could use at most: the free memory and what it already holds.
    reachable = m.free_bytes + m.torch_reserved_bytes + m.non_torch_bytes
    if reachable < budget:
        others = m.total_bytes - reachable
        raise MemoryBudgetError(
            f"--gpu-memory-utilization {utilization:g} asks for {_gib(budget)} of the "
            f"device's {_gib(m.total_bytes)}, but other processes (and this one's CUDA "
            f"context) hold {_gib(others)}: lower --gpu-memory-utilization to at most "
            f"{reachable / m.total_bytes:.2f}, or free the device"
        )
    fixed = (
        m.weight_bytes
        + m.activation_peak_bytes
        + m.non_torch_bytes
        + needs.cuda_graph_bytes
        + needs.decode_workspace_bytes
    )
    left = budget - fixed
    kv_bytes = int(left / (1.0 + needs.gather_bytes_per_kv_byte)) if left > 0 else 0
    if kv_bytes <= 0:
        raise MemoryBudgetError(
            f"no memory left for the KV cache: --gpu-memory-utilization {utilization:g} x "
            f"{_gib(m.total_bytes)} = {_gib(budget)}, and the worker needs {_gib(fixed)} "
            f"before any cache ({_gib(m.weight_bytes)} weights, "
            f"{_gib(m.activation_peak_bytes)} peak activations, "
            f"{_gib(m.non_torch_bytes)} outside torch, "
            f"{_gib(needs.cuda_graph_bytes)} CUDA graphs, "
            f"{_gib(needs.decode_workspace_bytes)} decode workspace). Raise "
            "--gpu-memory-utilization, lower --max-num-batched-tokens, drop --cuda-graphs or "
            "--decode-workspace-gib, or serve a smaller (or quantized) model; "
            "--kv-cache-gib or --num-kv-blocks size the cache yourself"
        )
    return kv_bytes


# Decode groups are padded to their longest context: about 1.15x the tokens they use for 64
# contexts spread over 64..512 tokens (model/attention_metadata.py, MAX_DECODE_GROUPS).
DECODE_GATHER_PADDING = 1.15


def gather_bytes_per_kv_byte(
    *, num_layers: int, stored_bytes_per_token: int, read_bytes_per_token: int
) -> float:
    """Transient bytes of a decode step's gather per byte of KV cache.

    A step gathers the decoding sequences' contexts one layer at a time, so at most one
    layer's cached tokens (1 / ``num_layers`` of the cache), padded, are copied at once: once
    as stored, and again as attention reads them when that differs (a quantized cache
    dequantized, a bf16 one widened on the CPU). Llama-3-8B in bf16 on a GPU: 1.15 / 32 =
    3.6 % of the cache; with an int8 cache, 1.15 x (1 + 256 / 130) / 32 = 10.7 %."""
    copies = stored_bytes_per_token
    if read_bytes_per_token != stored_bytes_per_token:
        copies += read_bytes_per_token
    return DECODE_GATHER_PADDING * copies / stored_bytes_per_token / num_layers


def cuda_graph_pool_bytes(
    *,
    max_padded_tokens: int,
    gather_bytes_per_token: int,
    batch_buckets: list[int],
    num_table_buckets: int,
    vocab_size: int,
    activation_bytes_per_row: int,
) -> int:
    """An estimate of the CUDA-graph pool (model/decode_graphs.py): what the largest bucket's
    forward holds at its peak (one layer's padded gather, its activations, its logits in the
    model's dtype and in float32), plus the float32 logits every captured graph keeps for its
    replays (one per batch bucket and table bucket). An estimate: the pool is shared by every
    bucket's graph, and what a graph frees during its capture is reused by the next."""
    largest = max(batch_buckets)
    peak = (
        max_padded_tokens * gather_bytes_per_token
        + largest * activation_bytes_per_row
        + largest * vocab_size * (4 + 4)
    )
    kept_logits = sum(batch_buckets) * num_table_buckets * vocab_size * 4
    return peak + kept_logits


@dataclass(frozen=True)
class HostMemory:
    """What the machine can still give this process, measured with the weights loaded."""

    available_bytes: int
    source: str  # what bounds it, for the message: "MemAvailable" or the cgroup file


def check_cpu_fit(
    host: HostMemory,
    *,
    weight_bytes: int,
    activation_peak_bytes: int,
    kv_cache_bytes: int,
    decode_workspace_bytes: int,
) -> None:
    """Raise MemoryBudgetError when the peak forward, the KV cache and the decode workspace
    (its most) do not fit beside the weights, which are already loaded and so are not in
    ``host.available_bytes`` any more."""
    needed = activation_peak_bytes + kv_cache_bytes + decode_workspace_bytes
    if needed <= host.available_bytes:
        return
    raise MemoryBudgetError(
        f"the worker would not fit in memory: beside its {_gib(weight_bytes)} of weights it "
        f"needs {_gib(needed)} ({_gib(kv_cache_bytes)} KV cache, "
        f"{_gib(decode_workspace_bytes)} decode workspace at most, "
        f"{_gib(activation_peak_bytes)} peak activations), and {host.source} leaves "
        f"{_gib(host.available_bytes)}. Lower --kv-cache-gib (or --num-kv-blocks), set "
        "--decode-workspace-gib lower (0 turns the workspace off), lower "
        "--max-num-batched-tokens, or give the worker more memory (its pod's memory limit)"
    )


def num_blocks_for(kv_cache_bytes: int, bytes_per_block: int, *, flag: str) -> int:
    """Whole blocks in ``kv_cache_bytes``; MemoryBudgetError naming ``flag`` if none fit."""
    num = kv_cache_bytes // bytes_per_block
    if num < 1:
        raise MemoryBudgetError(
            f"{flag} leaves {kv_cache_bytes} bytes for the KV cache, less than one block of "
            f"{bytes_per_block} bytes; raise it"
        )
    return num


def _gib(num_bytes: float) -> str:
    return f"{num_bytes / GIB:.2f} GiB"
