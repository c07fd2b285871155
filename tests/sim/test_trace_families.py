"""Generated trace families (cli/sim/trace_families.py), and the regression guard of the
time-based default: on a short generated conversation trace, in virtual time, the default
router's TTFT P90 is never worse than least-loaded's (docs/benchmarks.md, "Trace
families": the block-count default lost to it by 50 % and more)."""

from __future__ import annotations

from dataclasses import replace

from kvflow.engine_worker.sim.profiles import named_profile
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.trace import parse_trace
from kvflow.loadgen.trace_replay import TraceWorkload
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.ladders import SimLadder, run_ladder
from kvflow.sim.trace_families import FAMILIES, family, generate, trace_lines


def test_a_family_is_deterministic_by_seed_and_parses_as_a_mooncake_trace() -> None:
    a, b, c = (
        family("conv-7k-turns", seed=1),
        family("conv-7k-turns", seed=1),
        family("conv-7k-turns", seed=2),
    )
    assert a == b and a != c
    assert parse_trace(trace_lines(a), "generated") == a
    # Every prompt opens with the shared system prompt (block id 0) ...
    assert all(r.hash_ids[0] == 0 for r in a)
    # ... and a follow-up turn extends an earlier prompt: its ids start with that prompt's.
    earlier = {r.hash_ids for r in a}
    followups = [r for r in a if any(r.hash_ids[: len(p)] == p for p in earlier if len(p) > 1
                                     and len(p) < len(r.hash_ids))]  # fmt: skip
    assert len(followups) > 0.3 * len(a)
    mean_prompt = sum(r.input_length for r in a) / len(a)
    assert 6000 < mean_prompt < 9000


def test_agent_sessions_share_a_few_long_preambles() -> None:
    records = family("agent", num_requests=200)
    preamble = FAMILIES["agent"].preamble_tokens // 512
    assert len({r.hash_ids[:preamble] for r in records}) == FAMILIES["agent"].num_preambles


def test_the_default_router_waits_no_longer_than_least_loaded_on_a_conversation() -> None:
    profile = named_profile("h100-llama3-8b")
    assert profile is not None
    spec = ClusterSpec(profile, num_workers=4)
    # The shape, short: a 512-token system prompt, ~7K-token prompts, ~500-token
    # answers; 4 workers at 3 req/s and 6 req/s (the x2 rung is where the block default
    # fell furthest behind).
    shape = replace(FAMILIES["conv-7k"], num_requests=240, output_tokens=200)
    ladder = SimLadder("conv", TraceWorkload(generate(shape)),
                       [LoadPoint(ArrivalKind.TRACE, s) for s in (1, 2)], Slo(1.0, 0.1),
                       trace_warmup_s=10.0)  # fmt: skip
    p90 = {}
    for arm in ("kvflow", "least-loaded"):
        p90[arm] = [r.summary.latency.ttft_p90_with_failures_s for r in
                    run_ladder(spec, resolve_arm(arm), ladder)]  # fmt: skip
    for ours, theirs in zip(p90["kvflow"], p90["least-loaded"], strict=True):
        assert ours is not None and theirs is not None
        assert ours <= theirs, p90
