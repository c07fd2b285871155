"""One step-time model: the simulator, the planner, `kvflow plan` and the gateway's router price
an engine step with the same coefficients (kvflow.proto.step_model)."""

from __future__ import annotations

import pytest

from kvflow.cli.plan.steps import StepModel
from kvflow.engine_worker.sim.profiles import named_profile
from kvflow.operator.planner.capacity import decode_step_s
from kvflow.proto.step_model import StepShape, StepTiming
from kvflow.router.routing.cost import DEFAULT_STEP_COSTS

TIMING = StepTiming(5e-3, 50e-6, 40e-6, per_kv_token_s=2e-9, per_prefill_seq_s=1e-4)


@pytest.mark.parametrize("num_seqs,context_tokens", [(1, 0), (8, 1000), (64, 4096)])
def test_the_planner_prices_a_decode_step_as_the_simulator_does(
    num_seqs: int, context_tokens: int
) -> None:
    shape = StepShape(0, 0, num_seqs, num_seqs * context_tokens)
    assert decode_step_s(TIMING, num_seqs, context_tokens) == pytest.approx(TIMING.shape_s(shape))


def test_kvflow_plan_carries_the_shared_timing() -> None:
    assert StepModel.__dataclass_fields__["timing"].type in ("StepTiming", StepTiming)


def test_the_gateway_default_is_the_h100_profile() -> None:
    named = named_profile("h100-llama3-8b")
    assert named is not None
    profile = named.timing
    for name in ("base_step_s", "per_prefill_token_s", "per_decode_seq_s", "per_kv_token_s"):
        assert getattr(DEFAULT_STEP_COSTS.timing, name) == pytest.approx(
            getattr(profile, name), rel=0.01
        )
