"""The Batch API's day in virtual time (docs/benchmarks.md, "Batch API: a batch at the peak").

    python -m kvflow.sim.batch_day_cli --json docs/bench-data/batch-day.json [--seeds 10]

Two parts, one scenario (`SCENARIO`: the day of tests/sim/test_batch_day.py):

- **noise**: the day on two fixed workers, without the batch and with it, over `--seeds`
  seeds: online SLO attainment of each, their spread, and the paired difference (the same
  online requests with and without the batch);
- **planner**: the day on colocated replicas the SLO planner decides, for each batch
  concurrency in `--planner-in-flight`: without the batch, with it, and with it counted
  like online work (what the planner read before the metrics carried a class). The replicas
  every 5 s are in the JSON.

Prints a summary; exit status 0.
"""

from __future__ import annotations

import argparse
import dataclasses
import statistics
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TextIO

from kvflow.engine_worker.sim.profiles import SimProfile
from kvflow.loadgen.records import RequestRecord
from kvflow.loadgen.report_json import write_json
from kvflow.operator.planner import CapacityProfile, capacity_from_timing
from kvflow.proto.step_model import StepTiming
from kvflow.sim.autoscale import Slo
from kvflow.sim.autoscale_policies import Planner, planner_config
from kvflow.sim.autoscale_traffic import Traffic
from kvflow.sim.batch_day import BatchDay, PlannedDay, run_day, run_planned_day
from kvflow.sim.cluster import ClusterSpec

TIMING = StepTiming(base_step_s=0.010, per_prefill_token_s=0.0002, per_decode_seq_s=0.001)
PROFILE = SimProfile(name="batch-day", timing=TIMING, block_size=16,
                     kv_bytes_per_block=16 * 1024, num_kv_blocks=4096,
                     max_num_batched_tokens=2048, max_num_seqs=16, kv_link_bytes_per_s=1.6e6,
                     source="test")  # fmt: skip
DAY_S = 300.0  # a day, compressed; the batch's "24h" is the same span
# At the peak the two workers are busy (queues form now and then) but within the SLO.
TRAFFIC = Traffic("diurnal", DAY_S, 14.0, input_tokens=(128, 384), output_tokens=(16, 64))
DAY = BatchDay(TRAFFIC, num_lines=1000, submitted_at_s=DAY_S / 2, window_s=DAY_S,
               max_in_flight=4, input_tokens=256, output_tokens=32)  # fmt: skip
SLO = Slo(ttft_s=0.5, tpot_s=0.05)
NUM_WORKERS = 2
# The planner's clock, compressed with the day: a decision every 10 s over a 30 s window,
# replicas serving 10 s after they are ordered, a minute's scale-down stabilization.
PLANNER_INTERVAL_S = 10.0
STARTUP_S = 10.0
STABILIZATION_S = 60.0


def attainment(records: Sequence[RequestRecord]) -> float:
    """Share of the requests that ended without error within the SLO."""
    return sum(1 for r in records if r.error is None and SLO.is_met(r)) / len(records)


def capacity() -> CapacityProfile:
    """One replica's SLO capacity from the step-time profile, for the online traffic."""
    p = PROFILE
    return capacity_from_timing(
        p.timing,
        mean_input_tokens=sum(TRAFFIC.input_tokens) / 2,
        mean_output_tokens=sum(TRAFFIC.output_tokens) / 2,
        ttft_target_s=SLO.ttft_s,
        tpot_target_s=SLO.tpot_s,
        percentile=SLO.percentile,
        max_num_batched_tokens=p.max_num_batched_tokens,
        max_num_seqs=p.max_num_seqs,
        kv_capacity_tokens=p.num_kv_blocks * p.block_size,
        source=f"{p.name} (derived)",
        colocated=True,
    )


def planner() -> Planner:
    return Planner(planner_config(capacity=capacity(), min_replicas=1, max_replicas=8,
                                  initial=NUM_WORKERS, ttft_target_s=SLO.ttft_s,
                                  tpot_target_s=SLO.tpot_s, percentile=SLO.percentile,
                                  startup_s=STARTUP_S, interval_s=PLANNER_INTERVAL_S,
                                  scale_down_stabilization_s=STABILIZATION_S))  # fmt: skip


def _spread(values: Sequence[float]) -> dict[str, float]:
    return {
        "mean": statistics.fmean(values),
        "sd": statistics.stdev(values) if len(values) > 1 else 0.0,
        "min": min(values),
        "max": max(values),
    }


def noise(seeds: Sequence[int]) -> dict[str, Any]:
    spec = ClusterSpec(PROFILE, num_workers=NUM_WORKERS)
    runs: list[dict[str, Any]] = []
    alone_pct: list[float] = []
    shared_pct: list[float] = []
    for seed in seeds:
        alone = run_day(spec, DAY, with_batch=False, seed=seed)
        shared = run_day(spec, DAY, with_batch=True, seed=seed)
        alone_pct.append(100 * attainment(alone.online))
        shared_pct.append(100 * attainment(shared.online))
        runs.append({
            "seed": seed,
            "online_requests": len(alone.online),
            "attainment_pct_alone": alone_pct[-1],
            "attainment_pct_with_batch": shared_pct[-1],
            "batch_lines_ok": sum(1 for r in shared.batch if r.error is None),
            "batch_done_s": shared.batch_done_s,
        })  # fmt: skip
    paired = [b - a for a, b in zip(alone_pct, shared_pct, strict=True)]
    return {
        "runs": runs,
        "alone_pct": _spread(alone_pct),
        "with_batch_pct": _spread(shared_pct),
        "paired_difference_pts": _spread(paired),
    }


def _replicas(day: PlannedDay) -> dict[str, Any]:
    desired = [s.desired for s in day.replicas]
    return {
        "attainment_pct": 100 * attainment(day.day.online),
        "batch_done_s": day.day.batch_done_s,
        "most_desired": max(desired),
        "replica_seconds_holding": sum(s.holding for s in day.replicas) * 5.0,
        # time, desired, ready, holding a GPU: every 5 s
        "replicas": [[s.time_s, s.desired, s.ready, s.holding] for s in day.replicas],
        "decisions": [[d.time_s, d.replicas, d.reason] for d in day.decisions],
    }


@dataclass(frozen=True)
class PlannerArms:
    without: PlannedDay
    with_batch: PlannedDay
    batch_counted: PlannedDay


def planned(
    max_in_flight: int, seed: int, *, with_batch: bool, counts_batch: bool = False
) -> PlannedDay:
    """The day on the planner's replicas, `max_in_flight` batch lines at once."""
    day = dataclasses.replace(DAY, max_in_flight=max_in_flight)
    spec = ClusterSpec(PROFILE, num_workers=NUM_WORKERS)
    return run_planned_day(spec, day, planner(), startup_s=STARTUP_S, slo=SLO,
                           with_batch=with_batch, seed=seed,
                           counts_batch=counts_batch)  # fmt: skip


def planner_arms(max_in_flight: int, seed: int) -> PlannerArms:
    return PlannerArms(
        planned(max_in_flight, seed, with_batch=False),
        planned(max_in_flight, seed, with_batch=True),
        planned(max_in_flight, seed, with_batch=True, counts_batch=True),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m kvflow.sim.batch_day_cli",
                                description="A batch at the day's peak, in virtual time: "
                                "online SLO attainment over seeds, and the planner's "
                                "replicas with and without the batch.")  # fmt: skip
    p.add_argument("--json", help="write the report here")
    p.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 for the noise")
    p.add_argument("--planner-seed", type=int, default=3)
    p.add_argument("--planner-in-flight", type=int, nargs="+", default=[4, 16],
                   help="batch lines in flight at once, one planner run each")  # fmt: skip
    return p


def main(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = parser().parse_args(argv)
    if args.seeds < 2:
        print("--seeds: at least 2, for a spread", file=err)
        return 2
    report: dict[str, Any] = {
        "scenario": {
            "day_s": DAY_S, "peak_rate_per_s": TRAFFIC.peak_rate_per_s,
            "batch_lines": DAY.num_lines, "batch_submitted_at_s": DAY.submitted_at_s,
            "batch_max_in_flight": DAY.max_in_flight, "workers": NUM_WORKERS,
            "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s},
            "planner": {"interval_s": PLANNER_INTERVAL_S, "startup_s": STARTUP_S,
                        "stabilization_s": STABILIZATION_S},
        },
        "noise": noise(range(args.seeds)),
        "planner": {},
    }  # fmt: skip
    n = report["noise"]
    print(f"online attainment over {args.seeds} seeds, % (mean, sd, min-max):", file=out)
    for key in ("alone_pct", "with_batch_pct", "paired_difference_pts"):
        s = n[key]
        print(f"  {key}: {s['mean']:.2f} sd {s['sd']:.2f} [{s['min']:.2f}, {s['max']:.2f}]",
              file=out)  # fmt: skip
    for in_flight in args.planner_in_flight:
        arms = planner_arms(in_flight, args.planner_seed)
        entry: dict[str, Any] = {
            "without_batch": _replicas(arms.without),
            "with_batch": _replicas(arms.with_batch),
            "with_batch_counted_as_online": _replicas(arms.batch_counted),
        }
        desired = {k: [r[1] for r in v["replicas"]] for k, v in entry.items()}
        entry["same_replicas_with_and_without_batch"] = (
            desired["with_batch"] == desired["without_batch"]
        )
        report["planner"][f"in_flight_{in_flight}"] = entry
        print(f"planner, {in_flight} batch lines in flight: most replicas "
              + ", ".join(f"{k} {v['most_desired']}" for k, v in entry.items()
                          if isinstance(v, dict))
              + f"; same with and without: {entry['same_replicas_with_and_without_batch']}",
              file=out)  # fmt: skip
    if args.json:
        write_json(args.json, report)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
