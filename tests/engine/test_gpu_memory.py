"""``--gpu-memory-utilization`` on a real GPU (gpu-marked: bench/gpu_tests.sh runs it on a
device machine; skipped with its reason elsewhere). The worker measures its weights and a
peak forward, gives the rest of the budget to the KV cache, and a peak step then stays
inside the budget; an explicit size overrides it; a budget too small is refused with the
flags to change."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.settings import WorkerSettings

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not run here"),
]

GIB = 1024**3
# A quarter of the device: other tests of the same process keep what they cached, and a
# budget this size is still tens of GiB on any GPU these tests run on.
UTILIZATION = 0.25


@pytest.fixture(scope="module")
def model(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    # 56 M parameters (bench/engine_throughput.py's tiny): activations worth measuring.
    path = write_tiny_llama(
        tmp_path_factory.mktemp("gpu-mem") / "m", seed=0, vocab_size=32000, hidden_size=512,
        intermediate_size=1376, num_hidden_layers=8, num_attention_heads=8,
        num_key_value_heads=8,
    )  # fmt: skip
    return str(path), load_model(str(path), device="cuda")


@pytest.mark.parametrize("kv", ["auto", "int8"])
def test_the_cache_fills_the_budget_and_a_peak_step_stays_inside_it(
    model: tuple[str, Any], kv: str
) -> None:
    path, loaded = model
    torch.cuda.empty_cache()
    settings = WorkerSettings(
        model=path, device="cuda", gpu_memory_utilization=UTILIZATION, kv_cache_dtype=kv,
        max_num_batched_tokens=2048,
    )  # fmt: skip
    built = build_worker(settings, loaded=loaded)
    _, total = torch.cuda.mem_get_info()
    budget = UTILIZATION * total
    memory = built.memory
    assert f"--gpu-memory-utilization {UTILIZATION:g}" in memory.how
    weights = sum(memory.weight_bytes.values())
    # Weights and activations of a 56 M model are well under a GiB, so the budget is cache
    # and the room kept for a decode step's gather of one layer: with 8 layers, 1.15 / 8 of
    # the cache in float32, 1.15 x (66 + 256) / 66 / 8 = 70 % of an int8 one (dequantized
    # to float32). budget.gather_bytes_per_kv_byte.
    share = 1.15 / 8 if kv == "auto" else 1.15 * (66 + 256) / 66 / 8
    assert budget - GIB < memory.kv_cache_bytes * (1 + share) + weights < budget
    # A peak step: 2,048 prompt tokens in one step beside 60 decodes.
    engine = built.engine
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(60):
        engine.add_request(f"d{i}", [5 + i] * 40, params)
    engine.step()
    engine.add_request("long", [7] * 2040, params)
    while engine.has_unfinished_requests:
        engine.step()
    torch.cuda.synchronize()
    assert torch.cuda.max_memory_allocated() < budget, (torch.cuda.max_memory_allocated(), budget)
    del built, engine
    torch.cuda.empty_cache()


def test_an_explicit_size_overrides_the_utilization(model: tuple[str, Any]) -> None:
    path, loaded = model
    built = build_worker(
        WorkerSettings(model=path, device="cuda", kv_cache_gib=0.5, gpu_memory_utilization=0.9),
        loaded=loaded,
    )
    assert built.memory.how == "--kv-cache-gib 0.5"
    assert built.memory.kv_cache_bytes <= 0.5 * GIB


def test_a_budget_with_no_room_for_the_cache_is_refused(model: tuple[str, Any]) -> None:
    path, loaded = model
    # 0.0005 of an 80-141 GiB device is 40-70 MiB: under the 56 M model's 215 MiB of weights.
    with pytest.raises(SystemExit) as info:
        build_worker(
            WorkerSettings(model=path, device="cuda", gpu_memory_utilization=0.0005),
            loaded=loaded,
        )
    message = str(info.value.code)
    assert "no memory left for the KV cache" in message
    assert "--gpu-memory-utilization" in message and "--kv-cache-gib" in message
