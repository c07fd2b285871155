"""`kvflow worker --simulate --sim-profile`: the profile's timing and KV geometry; the old
flags unchanged; the two refused together."""

from __future__ import annotations

import pytest

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.settings import parse_args
from kvflow.engine_worker.sim.profile_file import resolve_profile
from kvflow.proto.step_model import StepTiming


def test_a_profile_sets_timing_and_kv_geometry() -> None:
    built = build_worker(parse_args(["--simulate", "--sim-profile", "h100-llama3-8b"]))
    profile = resolve_profile("h100-llama3-8b")
    assert built.runner.timing.timing == profile.timing  # type: ignore[attr-defined]
    assert built.engine.config.num_kv_blocks == 25_720
    assert built.info.num_total_blocks == 25_720
    assert built.runner.kv_bytes_per_block == 2 * 1024**2  # type: ignore[attr-defined]
    # Blocks of 32 tokens: half as many, twice the bytes, the same memory.
    built = build_worker(
        parse_args(["--simulate", "--sim-profile", "h100-llama3-8b", "--block-size", "32"])
    )
    assert built.engine.config.num_kv_blocks == 12_860
    assert built.runner.kv_bytes_per_block == 4 * 1024**2  # type: ignore[attr-defined]
    built = build_worker(
        parse_args(["--simulate", "--sim-profile", "h100-llama3-8b", "--num-kv-blocks", "64"])
    )
    assert built.engine.config.num_kv_blocks == 64


def test_the_old_flags_keep_their_model() -> None:
    args = ["--simulate", "--sim-base-step-ms", "20", "--sim-per-token-ms", "1",
            "--sim-per-seq-ms", "5"]  # fmt: skip
    built = build_worker(parse_args(args))
    assert built.runner.timing.timing == StepTiming.legacy(0.020, 0.001, 0.005)  # type: ignore[attr-defined]


def test_profile_and_old_flags_together_are_refused() -> None:
    args = ["--simulate", "--sim-profile", "h100-llama3-8b", "--sim-base-step-ms", "20"]
    with pytest.raises(SystemExit, match="drop the --sim-"):
        build_worker(parse_args(args))
    with pytest.raises(SystemExit, match="unknown profile 'h100'"):
        build_worker(parse_args(["--simulate", "--sim-profile", "h100"]))
