"""The memory budget's arithmetic over plain numbers (memory/budget.py), and the parsers of
what a machine or a container can still give (memory/host.py)."""

from __future__ import annotations

from pathlib import Path

import pytest

from kvflow.engine_worker.memory.budget import (
    GIB,
    GpuMeasurement,
    GpuNeeds,
    HostMemory,
    MemoryBudgetError,
    check_cpu_fit,
    cuda_graph_pool_bytes,
    gather_bytes_per_kv_byte,
    gpu_kv_cache_bytes,
    num_blocks_for,
)
from kvflow.engine_worker.memory.host import cgroup_room, host_memory, mem_available
from kvflow.engine_worker.memory.report import MemoryReport

# An H200 as torch reports it, serving Llama-3-8B in bf16 (15 GiB of weights).
H200 = GpuMeasurement(
    total_bytes=int(139.8 * GIB),
    free_bytes=int(123.8 * GIB),  # after the weights and the context
    torch_reserved_bytes=15 * GIB,
    weight_bytes=15 * GIB,
    activation_peak_bytes=2 * GIB,
    non_torch_bytes=GIB // 2,
)


def test_the_cache_gets_what_the_utilization_leaves() -> None:
    kv = gpu_kv_cache_bytes(H200, GpuNeeds(), utilization=0.9)
    # 0.9 x 139.8 = 125.82 GiB, less 15 + 2 + 0.5 GiB
    assert kv == int(0.9 * H200.total_bytes) - int(17.5 * GIB)
    graphs = GpuNeeds(cuda_graph_bytes=GIB, decode_workspace_bytes=2 * GIB)
    assert gpu_kv_cache_bytes(H200, graphs, utilization=0.9) == kv - 3 * GIB
    # The gather's transient copy of one layer grows with the cache: kv * (1 + r) must fit.
    gather = GpuNeeds(gather_bytes_per_kv_byte=0.036)
    assert gpu_kv_cache_bytes(H200, gather, utilization=0.9) == int(kv / 1.036)
    assert gpu_kv_cache_bytes(H200, GpuNeeds(), utilization=0.5) < kv // 1.5


def test_memory_other_processes_hold_is_outside_the_budget_and_said_so() -> None:
    # Another process holds 40 GiB: 0.9 of the device is no longer reachable.
    crowded = GpuMeasurement(**{**H200.__dict__, "free_bytes": int(83.8 * GIB)})
    with pytest.raises(MemoryBudgetError) as info:
        gpu_kv_cache_bytes(crowded, GpuNeeds(), utilization=0.9)
    message = str(info.value)
    assert "other processes" in message and "at most 0.71" in message
    assert "--gpu-memory-utilization" in message
    assert gpu_kv_cache_bytes(crowded, GpuNeeds(), utilization=0.7) > 0  # what it says works


def test_nothing_left_for_the_cache_names_the_flags_to_change() -> None:
    big = GpuMeasurement(**{**H200.__dict__, "weight_bytes": 130 * GIB})
    with pytest.raises(MemoryBudgetError) as info:
        gpu_kv_cache_bytes(big, GpuNeeds(), utilization=0.9)
    message = str(info.value)
    for flag in ("--gpu-memory-utilization", "--max-num-batched-tokens", "--kv-cache-gib",
                 "--num-kv-blocks"):  # fmt: skip
        assert flag in message
    assert "130.00 GiB weights" in message
    for bad in (0.0, 1.5, -0.1):
        with pytest.raises(MemoryBudgetError, match=r"\(0, 1\]"):
            gpu_kv_cache_bytes(H200, GpuNeeds(), utilization=bad)


def test_the_gathers_share_of_the_cache() -> None:
    # Llama-3-8B (32 layers, 8 KV heads of 128) on a GPU: a bf16 cache is read as stored.
    bf16 = gather_bytes_per_kv_byte(num_layers=32, stored_bytes_per_token=4096,
                                    read_bytes_per_token=4096)  # fmt: skip
    assert bf16 == pytest.approx(1.15 / 32)
    # int8 rows of 130 bytes, dequantized to 256: both copies live at once.
    int8 = gather_bytes_per_kv_byte(num_layers=32, stored_bytes_per_token=2 * 8 * 130,
                                    read_bytes_per_token=2 * 8 * 256)  # fmt: skip
    assert int8 == pytest.approx(1.15 * (1 + 256 / 130) / 32)


def test_the_graph_pool_estimate_adds_the_largest_step_and_every_graphs_logits() -> None:
    est = cuda_graph_pool_bytes(
        max_padded_tokens=1000, gather_bytes_per_token=10, batch_buckets=[1, 2, 4],
        num_table_buckets=3, vocab_size=100, activation_bytes_per_row=50,
    )  # fmt: skip
    assert est == 1000 * 10 + 4 * 50 + 4 * 100 * 8 + (1 + 2 + 4) * 3 * 100 * 4


def test_a_cpu_worker_fits_or_is_refused_with_the_flags_to_change() -> None:
    host = HostMemory(10 * GIB, "the container's memory limit (/sys/fs/cgroup/memory.max)")
    fits = {"weight_bytes": GIB, "activation_peak_bytes": GIB // 4,
            "kv_cache_bytes": 4 * GIB, "decode_workspace_bytes": 4 * GIB}  # fmt: skip
    check_cpu_fit(host, **fits)
    with pytest.raises(MemoryBudgetError) as info:
        check_cpu_fit(host, **{**fits, "decode_workspace_bytes": 6 * GIB})
    message = str(info.value)
    assert "10.25 GiB" in message and "leaves 10.00 GiB" in message
    assert "memory.max" in message
    for flag in ("--kv-cache-gib", "--decode-workspace-gib", "--max-num-batched-tokens"):
        assert flag in message


def test_whole_blocks_only() -> None:
    assert num_blocks_for(10 * 1000 + 999, 1000, flag="--kv-cache-gib 1") == 10
    with pytest.raises(MemoryBudgetError, match=r"--kv-cache-gib 0\.000001 leaves 999 bytes"):
        num_blocks_for(999, 1000, flag="--kv-cache-gib 0.000001")


def test_the_report_says_what_the_worker_holds() -> None:
    report = MemoryReport({"bfloat16": 15 * GIB, "float32": GIB // 256}, "int8+float16scales",
                          60 * GIB, 100_000, 16, "--kv-cache-gib 60")  # fmt: skip
    assert report.num_tokens == 1_600_000
    assert report.log_line() == (
        "memory: weights 15.00 GiB bfloat16 + 0.00 GiB float32; KV cache int8+float16scales "
        "60.00 GiB = 100000 blocks of 16 tokens = 1600000 tokens (--kv-cache-gib 60)"
    )


MEMINFO = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   20971520 kB\n"


def test_meminfo_and_cgroup_files_parse() -> None:
    assert mem_available(MEMINFO) == 20 * GIB
    with pytest.raises(ValueError, match="MemAvailable"):
        mem_available("MemTotal: 1 kB\n")
    stat = "anon 100\ninactive_file 1073741824\nactive_file 5\n"
    # 8 GiB limit, 3 GiB charged of which 1 GiB is reclaimable page cache: 6 GiB left.
    assert cgroup_room(f"{8 * GIB}\n", f"{3 * GIB}\n", stat, "inactive_file") == 6 * GIB
    assert cgroup_room("max\n", "5\n", stat, "inactive_file") is None  # v2: no limit
    assert cgroup_room("9223372036854771712\n", "5\n", "", "total_inactive_file") is None  # v1


def test_the_tighter_of_the_machine_and_the_container_bounds_the_worker(tmp_path: Path) -> None:
    meminfo = tmp_path / "meminfo"
    meminfo.write_text(MEMINFO)
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text(f"{4 * GIB}\n")
    (v2 / "memory.current").write_text(f"{GIB}\n")
    (v2 / "memory.stat").write_text("inactive_file 0\n")
    assert host_memory(v2, meminfo) == HostMemory(
        3 * GIB, f"the container's memory limit ({v2 / 'memory.max'})"
    )
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    (v1 / "memory" / "memory.limit_in_bytes").write_text(f"{64 * GIB}\n")
    (v1 / "memory" / "memory.usage_in_bytes").write_text(f"{GIB}\n")
    (v1 / "memory" / "memory.stat").write_text("total_inactive_file 0\n")
    # The container allows 63 GiB more, the machine 20: the machine bounds it.
    assert host_memory(v1, meminfo) == HostMemory(20 * GIB, "the machine's MemAvailable")
    assert host_memory(tmp_path / "none", meminfo).available_bytes == 20 * GIB
