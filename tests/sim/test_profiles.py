"""Profile arithmetic against hand-computed numbers, the step model, and profile files."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvflow.engine_worker.core.request import Request
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.core.scheduler import ScheduledRequest, SchedulerOutput
from kvflow.engine_worker.sim.hardware import H100_SXM, H200_SXM, LLAMA3_8B, LLAMA3_70B
from kvflow.engine_worker.sim.profile_file import (
    ProfileError,
    read_profile,
    resolve_profile,
    write_profile,
)
from kvflow.engine_worker.sim.profiles import SHIPPED, Efficiency, roofline_timing
from kvflow.engine_worker.sim.timing import step_shape
from kvflow.proto.step_model import StepShape, StepTiming


def test_llama3_shapes() -> None:
    # 2 (K, V) x 32 layers x 8 KV heads x 128 x 2 bytes = 128 KiB per token.
    assert LLAMA3_8B.kv_bytes_per_token == 128 * 1024
    assert LLAMA3_8B.num_params == 8_030_261_248  # the model card's 8.03 B
    # 2 x 80 x 8 x 128 x 2 = 320 KiB; 70.55 B parameters.
    assert LLAMA3_70B.kv_bytes_per_token == 320 * 1024
    assert round(LLAMA3_70B.num_params / 1e9, 2) == 70.55
    # A step reads every weight but the embedding table: 15.0 GB (facts/benchmarks.md).
    assert round(LLAMA3_8B.step_weight_bytes / 1e9, 2) == 15.01


def test_h200_batch_one_decode_tops_out_near_320_tokens_per_second() -> None:
    # At the full 4.8 TB/s and no overhead, a 15.0 GB step takes 3.13 ms: 320 tokens/s.
    ideal = Efficiency(memory=1.0, step_overhead_s=0.0, per_seq_overhead_s=0.0)
    timing = roofline_timing(H200_SXM, LLAMA3_8B, 1, ideal)
    step_s = timing.shape_s(StepShape(0, 0, 1, 0))
    assert 1 / step_s == pytest.approx(320, rel=0.01)


def test_h100_llama3_8b_profile_by_hand() -> None:
    p = resolve_profile("h100-llama3-8b")
    t = p.timing
    # 15.0098 GB at 0.8 x 3.35 TB/s = 5.601 ms, + 1 ms overhead.
    assert t.base_step_s == pytest.approx(15.0098e9 / (0.8 * 3.35e12) + 1e-3, rel=1e-4)
    assert t.base_step_s * 1e3 == pytest.approx(6.60, abs=0.01)
    # (15.0098 + 4 x 32 x 4096 x 2048 / 1e9 = 1.0737) GFLOP at 0.6 x 989 TFLOPS = 27.10 us.
    assert t.per_prefill_token_s * 1e6 == pytest.approx(27.10, abs=0.01)
    # 15.0098 GFLOP at 593.4 TFLOPS = 25.29 us, + 5 us.
    assert t.per_decode_seq_s * 1e6 == pytest.approx(30.29, abs=0.01)
    # 131,072 bytes at 2.68 TB/s = 48.9 ns.
    assert t.per_kv_token_s * 1e9 == pytest.approx(48.91, abs=0.01)
    # (0.9 x 80 GB - 2 GB - 16.06 GB) / 131,072 B = 411,523 tokens = 25,720 blocks of 16.
    assert p.num_kv_blocks == 25_720
    assert p.kv_bytes_per_block == 16 * 128 * 1024
    # PD: a 4k-token prompt (256 blocks, 512 MiB) at 85 % of 400 Gb/s = 12.6 ms.
    assert p.transfer_s(256) == pytest.approx(256 * 2 * 1024**2 / 42.5e9)


def test_h200_is_the_h100_with_more_memory_bandwidth() -> None:
    h100, h200 = resolve_profile("h100-llama3-8b"), resolve_profile("h200-llama3-8b")
    assert h200.timing.per_prefill_token_s == h100.timing.per_prefill_token_s  # same FLOPS
    assert h200.timing.per_kv_token_s == pytest.approx(h100.timing.per_kv_token_s * 3.35 / 4.8)
    assert h200.num_kv_blocks > 2 * h100.num_kv_blocks  # 141 GB vs 80 GB, less 16 GB
    assert H100_SXM.peak_bf16_flops == H200_SXM.peak_bf16_flops


def test_70b_needs_tensor_parallelism() -> None:
    with pytest.raises(ProfileError, match="no room for KV"):
        resolve_profile("h100-llama3-70b")
    tp4 = resolve_profile("h100x4-llama3-70b")
    # 4 GPUs at 85 %: 139.0 GB of weights per step at 4 x 0.85 x 0.8 x 3.35 TB/s = 15.26 ms.
    assert tp4.timing.base_step_s * 1e3 == pytest.approx(139.006 / (4 * 0.85 * 0.8 * 3.35) + 1,
                                                          abs=0.01)  # fmt: skip
    for name in SHIPPED:
        assert resolve_profile(name).num_kv_blocks > 10_000


def test_unknown_profile_names_the_shipped_ones() -> None:
    with pytest.raises(ProfileError, match="h100-llama3-8b, h200-llama3-8b"):
        resolve_profile("a100-llama3-8b")


def test_profile_file_round_trip_and_refusals(tmp_path: Path) -> None:
    path = tmp_path / "p.json"
    write_profile(resolve_profile("h200-llama3-8b"), path)
    assert read_profile(path) == resolve_profile("h200-llama3-8b")
    assert resolve_profile(str(path)) == read_profile(path)
    data = json.loads(path.read_text())
    data["timing"]["per_token_s"] = 1.0
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="per_token_s"):
        read_profile(path)
    del data["timing"]["per_token_s"]
    data["num_kv_blocks"] = 0
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match="must be >= 1"):
        read_profile(path)
    data["num_kv_blocks"], data["tp"] = 10, 2
    path.write_text(json.dumps(data))
    with pytest.raises(ProfileError, match=r"unknown fields \['tp'\]"):
        read_profile(path)


def _request(rid: str, prompt: int, outputs: int = 0) -> Request:
    r = Request(rid, list(range(prompt)), SamplingParams(), 0.0)
    r.token_ids += [1] * outputs
    return r


def test_step_shape_classifies_prefill_and_decode() -> None:
    chunk = _request("chunk", 1000)  # a prompt chunk of 512 after 256 cached
    decode = _request("decode", 100, outputs=5)  # computes its newest output token
    last = _request("last", 64)  # a full cache hit: only the last prompt token
    recompute = _request("re", 40, outputs=10)  # preempted: prompt and outputs again
    out = SchedulerOutput(
        scheduled=[
            ScheduledRequest(chunk, 256, 512, []),
            ScheduledRequest(decode, 104, 1, []),
            ScheduledRequest(last, 63, 1, []),
            ScheduledRequest(recompute, 0, 50, []),
        ]
    )
    shape = step_shape(out)
    assert shape == StepShape(
        num_prefill_tokens=512 + 1 + 50,
        num_prefill_seqs=3,
        num_decode_seqs=1,
        num_kv_tokens_read=768 + 105 + 64 + 50,
    )
    # The ideal arm's discount: 600 of chunk's tokens are free (256-600 of this chunk),
    # and all of the last one's.
    discounted = step_shape(out, {"chunk": 600, "last": 64})
    assert discounted.num_prefill_tokens == (768 - 600) + 0 + 50


def test_legacy_flags_keep_their_formula() -> None:
    base, per_token, per_seq = 0.02, 0.001, 0.005
    timing = StepTiming.legacy(base, per_token, per_seq)
    shape = StepShape(num_prefill_tokens=300, num_prefill_seqs=2, num_decode_seqs=7,
                      num_kv_tokens_read=5000)  # fmt: skip
    # The old model: base + per_token x batched tokens + per_seq x sequences.
    assert timing.shape_s(shape) == pytest.approx(base + per_token * 307 + per_seq * 9)
    with pytest.raises(ValueError, match="must be >= 0"):
        StepTiming(per_kv_token_s=-1.0)
