"""The SLO planner's pure model: replica decisions from observed metrics (no I/O).

The operator calls `plan(config, observations, state)` once per interval (`model.py`), with
a config from `config_from_spec`; `types.py` is the contract; docs/planner.md explains the
rules. Held by import-linter: nothing here imports kopf, kubernetes, an HTTP client, a
clock or the operator's I/O modules.
"""

from kvflow.operator.planner.capacity import capacity_from_timing
from kvflow.operator.planner.config import capacity_from_spec, config_from_spec
from kvflow.operator.planner.model import plan
from kvflow.operator.planner.types import (
    CapacityProfile,
    Decision,
    DecisionReason,
    Observation,
    Plan,
    PlannerConfig,
    PlannerState,
    RoleConfig,
    RoleState,
    SloReason,
    SloStatus,
    SloVerdict,
    Tuning,
    WorkerRole,
)

__all__ = [
    "CapacityProfile",
    "Decision",
    "DecisionReason",
    "Observation",
    "Plan",
    "PlannerConfig",
    "PlannerState",
    "RoleConfig",
    "RoleState",
    "SloReason",
    "SloStatus",
    "SloVerdict",
    "Tuning",
    "WorkerRole",
    "capacity_from_spec",
    "capacity_from_timing",
    "config_from_spec",
    "plan",
]
