"""What a worker holds and whether it fits, measured for real: the weights' bytes by dtype,
a CPU worker checked against this machine's memory (refused when it would not fit, in
process and as a real `kvflow worker` that exits with the message), its start-up line and
its /metrics gauges; and the flags' refusals at parse time."""

from __future__ import annotations

import subprocess
import sys
import urllib.request
from pathlib import Path

import pytest
import torch
from testkit.tiny_model import write_tiny_llama
from testkit.worker_process import running_worker

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.memory.host import host_memory
from kvflow.engine_worker.memory.weight_memory import weight_memory
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.settings import WorkerSettings, parse_args

GIB = 1024**3


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("mem") / "m", seed=1)


def test_weights_are_counted_once_per_tensor_by_dtype(tmp_path: Path) -> None:
    # 2 layers of hidden 64, 4 heads of 16 (2 KV), MLP 128, vocabulary 1,000.
    untied = write_tiny_llama(tmp_path / "untied", vocab_size=1000)
    tied = write_tiny_llama(tmp_path / "tied", vocab_size=1000, tie_word_embeddings=True)
    per_layer = 64 * (64 + 2 * 32) + 64 * 64 + 64 * 2 * 128 + 128 * 64 + 2 * 64
    params = 2 * per_layer + 1000 * 64 + 64  # layers, embeddings, final norm
    # Buffers: each RMSNorm's eps (5 of them) and RoPE's cos and sin tables [2048, 16].
    buffers = 5 * 4 + 2 * 2048 * 16 * 4
    model, _ = load_model(str(tied))
    assert weight_memory(model) == {"float32": 4 * params + buffers}  # the head is the table
    model, _ = load_model(str(untied))
    assert weight_memory(model) == {"float32": 4 * (params + 1000 * 64) + buffers}
    model, _ = load_model(str(untied), dtype=torch.bfloat16)
    assert weight_memory(model) == {"bfloat16": 2 * (params + 1000 * 64), "float32": buffers}


def test_a_buffer_that_aliases_a_parameter_counts_once() -> None:
    """Two tensor objects over one memory (a packed weight kept as a buffer beside a view of
    it, say) are one set of bytes; two different tensors of the same size are two."""
    module = torch.nn.Module()
    module.weight = torch.nn.Parameter(torch.zeros(64, 32))
    module.register_buffer("alias", module.weight.data)
    module.register_buffer("other", torch.zeros(64, 32))
    assert weight_memory(module) == {"float32": 2 * 64 * 32 * 4}


def test_a_cpu_worker_reports_what_it_holds(tiny: Path) -> None:
    built = build_worker(
        WorkerSettings(model=str(tiny), kv_cache_gib=0.01, kv_cache_dtype="int8"),
        loaded=load_model(str(tiny)),
    )
    m = built.memory
    assert m.kv_cache_dtype == "int8+float16scales" and set(m.weight_bytes) == {"float32"}
    assert m.num_blocks == built.info.num_total_blocks
    assert m.num_tokens == m.num_blocks * built.info.block_size
    assert m.kv_cache_bytes == sum(c.nbytes for c in built.runner.kv_caches)  # type: ignore[attr-defined]
    assert "--kv-cache-gib 0.01; peak activations" in m.log_line()


def test_a_cpu_worker_that_would_not_fit_is_refused_before_it_allocates(tiny: Path) -> None:
    room = host_memory().available_bytes
    gib = 2 * room / GIB  # twice what this machine (or container) can still give
    with pytest.raises(SystemExit) as info:
        build_worker(
            WorkerSettings(model=str(tiny), kv_cache_gib=gib, decode_workspace_gib=0.0),
            loaded=load_model(str(tiny)),
        )
    message = str(info.value.code)
    assert "would not fit in memory" in message and "--kv-cache-gib" in message
    # The decode workspace counts too, where decodes use it (not through the paged kernel):
    # a cache that fits alone, with a workspace that does not.
    with pytest.raises(SystemExit, match="--decode-workspace-gib"):
        build_worker(
            WorkerSettings(model=str(tiny), kv_cache_gib=0.01, decode_workspace_gib=gib,
                           paged_attention=False),
            loaded=load_model(str(tiny)),
        )  # fmt: skip
    # Through the kernel it is never allocated, so it reserves nothing.
    built = build_worker(
        WorkerSettings(model=str(tiny), kv_cache_gib=0.01, decode_workspace_gib=gib),
        loaded=load_model(str(tiny)),
    )
    assert built.runner.workspace is None  # type: ignore[attr-defined]


@pytest.mark.integration
def test_a_real_worker_exits_with_the_message(tiny: Path) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "kvflow.cli.main", "worker", "--model", str(tiny),
         "--port", "0", "--metrics-port", "0", "--kv-port", "0", "--kv-cache-gib", "100000"],
        capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode != 0
    assert "would not fit in memory" in done.stderr and "Lower --kv-cache-gib" in done.stderr


def metrics(port: int) -> dict[str, float]:
    body = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics").read().decode()
    return {
        line.rsplit(" ", 1)[0]: float(line.rsplit(" ", 1)[1])
        for line in body.splitlines()
        if line.startswith("kvflow_worker_") and not line.startswith("#")
    }


@pytest.mark.integration
def test_a_real_worker_exports_its_weights_and_cache(tiny: Path) -> None:
    args = ["--model", str(tiny), "--kv-cache-dtype", "int8", "--kv-cache-gib", "0.01"]
    with running_worker(args, timeout_s=120) as worker:
        m = metrics(worker.metrics_port)
        line = next(x for x in worker.log.splitlines() if "memory: weights" in x)
    assert "GiB float32; KV cache int8+float16scales 0.01 GiB" in line
    assert "(--kv-cache-gib 0.01; peak activations" in line
    blocks = int(0.01 * GIB) // (2 * 2 * 16 * 2 * 18)  # 2,304 bytes a block
    assert m["kvflow_worker_kv_cache_blocks"] == blocks
    assert m["kvflow_worker_kv_cache_tokens"] == blocks * 16
    assert m['kvflow_worker_kv_cache_bytes{dtype="int8+float16scales"}'] == blocks * 2304
    weights = load_model(str(tiny))[0]
    assert m['kvflow_worker_weight_bytes{dtype="float32"}'] == weight_memory(weights)["float32"]
    # The device split, from the same accounting; a CPU has no graphs and no "other".
    assert m['kvflow_worker_device_memory_bytes{part="weights"}'] == sum(
        weight_memory(weights).values()
    )
    assert m['kvflow_worker_device_memory_bytes{part="kv_cache"}'] == blocks * 2304
    assert m['kvflow_worker_device_memory_bytes{part="cuda_graphs"}'] == 0
    assert 'kvflow_worker_device_memory_bytes{part="other"}' not in m


def test_flags_refuse_what_cannot_work(capsys: pytest.CaptureFixture[str]) -> None:
    defaults = parse_args([])
    assert defaults.kv_cache_gib is None and defaults.gpu_memory_utilization == 0.9
    assert defaults.cpu_kv_cache_gib() == 1.0  # the CPU's default size
    on_gpu = parse_args(["--device", "cuda", "--gpu-memory-utilization", "0.5"])
    assert on_gpu.gpu_memory_utilization == 0.5
    for argv, says in (
        (["--gpu-memory-utilization", "0.5"], "on the CPU (or with --simulate) size the KV"),
        (["--device", "cuda", "--gpu-memory-utilization", "1.2"], "must lie in (0, 1]"),
        (["--device", "cuda", "--gpu-memory-utilization", "0"], "must lie in (0, 1]"),
        (["--kv-cache-gib", "0"], "must be a number of GiB > 0"),
        (["--kv-cache-gib", "nan"], "must be a number of GiB > 0"),
    ):
        with pytest.raises(SystemExit):
            parse_args(argv)
        assert says in capsys.readouterr().err, argv
