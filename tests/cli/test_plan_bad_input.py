"""`kvflow plan` refuses bad input with a message that says what to change."""

from __future__ import annotations

import json
from dataclasses import replace
from pathlib import Path

import pytest
import yaml

from kvflow.cli.plan.deployment import Deployment
from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.gpus import BUILTIN, extend_catalog, find_gpu
from kvflow.cli.plan.model_files import read_model_path
from kvflow.cli.plan.models import ModelSpec, from_flags, preset
from kvflow.cli.plan.plan import PlanInputs, make_plan
from kvflow.cli.plan.workload import Slo, Target, parse_mix, workload
from kvflow.engine_worker.sim.profiles import Efficiency


def llama(name: str) -> ModelSpec:
    model = preset(name)
    assert model is not None
    return model


def bf16_on(gpu: str, tp: int = 1) -> Deployment:
    return Deployment(BUILTIN[gpu], tp, "bf16", 2, "bf16", 2)


def test_an_unknown_gpu_lists_the_known_ones() -> None:
    with pytest.raises(PlanError) as err:
        find_gpu("b200", BUILTIN)
    assert str(err.value).startswith("unknown GPU 'b200': use one of a100-40gb, a100-80gb, h100")
    assert "rtx-4090" in str(err.value) and "--gpu-file" in str(err.value)
    # Case, dashes and the datasheet's own name all find an entry.
    assert find_gpu("RTX4090", BUILTIN).key == "rtx-4090"
    assert find_gpu("H100-SXM", BUILTIN).key == "h100"


def test_a_model_that_does_not_fit_says_what_is_missing_and_what_fits() -> None:
    work = workload(1024, 256)
    with pytest.raises(PlanError) as err:
        make_plan(PlanInputs(llama("llama-3-70b"), work, bf16_on("h100")))
    text = str(err.value)
    # 141.11 GB of weights + 2 GB + 1,280 x 327,680 = 0.42 GB of KV = 143.5 GB against
    # 0.9 x 80 = 72 GB: 71.5 GB missing. 2 x H100 gives 144 - 141.1 - 4 < 0; 4 fit. fp8
    # weights (70.6 GB) + 2.4 still exceed 72 GB; int4 (35.3 GB) fits.
    assert "Llama-3-70B does not fit on 1 x H100-SXM" in text
    assert "= 143.5 GB, but 90% of 80 GB is 72.0 GB: 71.5 GB missing" in text
    assert "--tp 4 fits" in text
    assert "--weight-dtype int4: 35.3 GB" in text and "fp8" not in text


def test_an_slo_no_batch_meets_names_the_step_and_a_fix() -> None:
    # One decode step of Llama-3-8B on an H100 reads 15 GB at 2.68 TB/s: 5.6 + 1 ms, plus
    # a sequence's matmuls and KV: 6.8 ms > 5 ms. Over 2 GPUs (x 1.7): 3.3 + 1 ms meets it.
    slo = Slo(tpot_s=0.005)
    with pytest.raises(PlanError) as err:
        make_plan(PlanInputs(llama("llama-3-8b"), workload(1024, 256), bf16_on("h100"), slo=slo))
    text = str(err.value)
    assert "no batch meets the SLO on 1 x H100-SXM: TPOT 5 ms" in text
    assert "one decode step at batch 1 takes 6.79 ms" in text
    assert "Use --tp 2 (it meets the SLO)" in text


def test_a_request_longer_than_the_model_context() -> None:
    with pytest.raises(
        PlanError, match="needs 8500 tokens of context but Llama-3-8B takes at most 8192"
    ):
        make_plan(PlanInputs(llama("llama-3-8b"), workload(8000, 500), bf16_on("h100")))


@pytest.mark.parametrize(
    ("text", "message"),
    [
        ("512", "expected INPUT:OUTPUT"),
        ("512:x", "expected INPUT:OUTPUT"),
        ("512:128:0", "the share > 0"),
        ("0:128", "must be >= 1"),
    ],
)
def test_bad_mixes(text: str, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        parse_mix(text)


def test_bad_targets_and_flags() -> None:
    with pytest.raises(PlanError, match="not both"):
        Target(concurrency=4, rate_per_s=1.0)
    with pytest.raises(PlanError, match="--rate must be > 0"):
        Target(rate_per_s=0)
    with pytest.raises(PlanError, match="--kv-heads 3 must divide --heads 8"):
        from_flags(params_b=1, num_layers=2, num_heads=8, num_kv_heads=3, head_dim=64,
                   max_context_tokens=None)  # fmt: skip
    with pytest.raises(PlanError, match=r"--mfu must be in \(0, 1\]"):
        replace(bf16_on("h100"), eff=Efficiency(compute=1.5))


def test_a_gpu_file_adds_types_and_prices(tmp_path: Path) -> None:
    text = """
gpus:
  mi300x: {memory_gb: 192, memory_bandwidth_gb_s: 5300, bf16_tflops: 1307,
           price_per_gpu_hour: 3.5}
  H100-SXM: {price_per_gpu_hour: 2.49}
"""
    catalog = extend_catalog(BUILTIN, yaml.safe_load(text), "gpus.yaml")
    mi300x = find_gpu("mi300x", catalog)
    assert mi300x.spec.hbm_bytes == 192e9 and mi300x.spec.hbm_bytes_per_s == 5.3e12
    assert mi300x.spec.peak_bf16_flops == 1307e12 and mi300x.price_per_gpu_hour == 3.5
    h100 = find_gpu("h100", catalog)
    assert h100.spec == BUILTIN["h100"].spec and h100.price_per_gpu_hour == 2.49
    assert BUILTIN["h100"].price_per_gpu_hour is None  # the built-in table is untouched
    # JSON is YAML: the same file as JSON reads the same.
    as_json = json.dumps({"gpus": {"mi300x": {"memory_gb": 192, "memory_bandwidth_gb_s": 5300,
                                              "bf16_tflops": 1307}}})  # fmt: skip
    assert find_gpu("mi300x", extend_catalog(BUILTIN, yaml.safe_load(as_json), "g.json"))


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"gpu": {}}, "one top-level key 'gpus'"),
        ({"gpus": {"x": {"memory_gb": 80}}}, "new GPU 'x' needs"),
        ({"gpus": {"h100": {"memory": 80}}}, "unknown fields"),
        ({"gpus": {"h100": {"memory_gb": -1}}}, "must be a number > 0"),
    ],
)
def test_bad_gpu_files(data: object, message: str) -> None:
    with pytest.raises(PlanError, match=message):
        extend_catalog(BUILTIN, data, "gpus.yaml")


def test_bad_model_paths(tmp_path: Path) -> None:
    with pytest.raises(PlanError, match="not a model folder"):
        read_model_path(tmp_path / "missing.bin")
    with pytest.raises(PlanError, match=r"cannot read .*config\.json"):
        read_model_path(tmp_path)
    (tmp_path / "config.json").write_text(json.dumps({"architectures": ["GPT2LMHeadModel"]}))
    with pytest.raises(
        PlanError, match="'architectures' = \\['GPT2LMHeadModel'\\] is not supported"
    ):
        read_model_path(tmp_path)
    (tmp_path / "bad.gguf").write_bytes(b"not a gguf file")
    with pytest.raises(PlanError, match="is not a readable GGUF file"):
        read_model_path(tmp_path / "bad.gguf")
