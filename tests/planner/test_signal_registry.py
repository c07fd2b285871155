"""The planner's signals are records in one registry, and `assess` is a loop over them."""

from __future__ import annotations

import dataclasses
import typing
from typing import Any

import pytest
from planner.history import TPOT_S, TTFT_S, calm, config

from kvflow.operator.planner import registry, signals
from kvflow.operator.planner.registry import SIGNALS, Reading, Signal, SignalContext, Want
from kvflow.operator.planner.signals import Loads, assess
from kvflow.operator.planner.types import DecisionReason, Observation, WorkerRole

NO_LOAD = Loads(None, None, "")
# An observation that makes each signal ask for more replicas, and nothing else.
HOT: dict[str, dict[str, Any]] = {
    "TTFT": {"ttft_s": 2 * TTFT_S},
    "queue wait": {"prefill_queue_wait_s": 0.9, "ttft_s": 0.9 * TTFT_S},
    "TPOT": {"tpot_s": 2 * TPOT_S},
    "KV usage": {"kv_usage": 0.97},
}
ROLE_OF_SIDE: dict[str, WorkerRole] = {"prefill": "prefill", "decode": "decode"}


def run(role: WorkerRole, obs: Observation) -> signals.Assessment:
    cfg = config(role)
    return assess(role, obs, cfg, cfg.roles[role], NO_LOAD)


def test_records_are_well_formed() -> None:
    fields = {f.name for f in dataclasses.fields(Observation)}
    reasons = set(typing.get_args(DecisionReason))
    assert len({s.name for s in SIGNALS}) == len(SIGNALS)
    for signal in SIGNALS:
        assert set(signal.inputs) <= fields, signal.name
        assert set(signal.asks) <= reasons, signal.name
        assert signal.side in ("prefill", "decode") and signal.calm_when
    assert set(HOT) == {s.name for s in SIGNALS}, "every signal needs a hot case here"


@pytest.mark.parametrize("signal", SIGNALS, ids=lambda s: s.name)
def test_each_signal_asks_with_its_declared_reason(signal: Signal) -> None:
    role = ROLE_OF_SIDE[signal.side]
    assert run(role, calm(0, 2)).wants == ()
    wants = run(role, calm(0, 2, **HOT[signal.name])).wants
    assert [w.reason for w in wants] == list(signal.asks)
    assert all(w.replicas > 2 for w in wants)


@pytest.mark.parametrize("signal", SIGNALS, ids=lambda s: s.name)
def test_a_missing_input_holds_the_role_and_is_named(signal: Signal) -> None:
    role = ROLE_OF_SIDE[signal.side]
    gone = dict.fromkeys(signal.inputs)
    assessment = run(role, calm(0, 2, **gone))
    assert assessment.down_to is None  # a missing metric never reads as calm
    assert set(assessment.missing) & set(signal.inputs)
    # With no traffic, nothing is missing: an idle role's latencies are not measured.
    assert run(role, calm(0, 2, request_rate_per_s=0.0, **gone)).missing == ()


def test_colocated_reads_every_signal_in_registry_order() -> None:
    hot = {k: v for case in HOT.values() for k, v in case.items()}
    hot["ttft_s"] = 2 * TTFT_S
    wants = run("colocated", calm(0, 2, **hot)).wants
    assert [w.reason for w in wants] == [r for s in SIGNALS for r in s.asks]


def test_a_registered_signal_is_consulted(monkeypatch: pytest.MonkeyPatch) -> None:
    def read_batch(ctx: SignalContext, r: Reading) -> None:
        batch = ctx.obs.decode_batch_size
        if batch is not None and batch > 64:
            r.wants.append(Want(ctx.obs.ready_replicas + 1, "KvPressure", "big batch", True))
        elif batch is not None and batch > 32:
            r.not_calm.append(f"batch {batch:g}")

    extra = Signal("decode batch", "decode", ("decode_batch_size",), ("KvPressure",),
                   "a batch under 32", read_batch)  # fmt: skip
    monkeypatch.setattr(signals, "SIGNALS", (*registry.SIGNALS, extra))
    assert [w.detail for w in run("decode", calm(0, 2, decode_batch_size=100.0)).wants] == [
        "big batch"
    ]
    assert "batch 40" in run("decode", calm(0, 2, decode_batch_size=40.0)).hold_note
