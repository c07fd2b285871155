"""The Batch API's day in virtual time (docs/benchmarks.md, "Batch API: a batch at the peak").

    kvflow sim batch-day --json docs/bench-data/batch-day.json [--seeds 10]

(``python -m kvflow.sim.batch_day_cli`` is the same command.)

Two parts, one scenario (`SCENARIO`: the day of tests/sim/test_batch_day.py):

- **noise**: the day on two fixed workers, without the batch and with it, over `--seeds`
  seeds: online SLO attainment of each, their spread, and the paired difference (the same
  online requests with and without the batch), with its standard error and whether it is
  within noise (within two standard errors of 0, and no seed with the batch below the
  lowest without it);
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
from kvflow.proto.cli_args import positive_int
from kvflow.proto.step_model import StepTiming
from kvflow.router.batch.pacing import DEFAULT_TPOT_HEADROOM_FRACTION, TpotHeadroom
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
SLO = Slo(ttft_s=0.5, tpot_s=0.05)
# The runner leaves the online TPOT alone (batch/pacing.py): a worker's decode step with a
# line added stays within 0.3 of the online TPOT target.
DAY = BatchDay(TRAFFIC, num_lines=1000, submitted_at_s=DAY_S / 2, window_s=DAY_S,
               max_in_flight=4, input_tokens=256, output_tokens=32,
               tpot_headroom=TpotHeadroom(SLO.tpot_s, DEFAULT_TPOT_HEADROOM_FRACTION))  # fmt: skip
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


def noise(seeds: Sequence[int], day: BatchDay = DAY) -> dict[str, Any]:
    spec = ClusterSpec(PROFILE, num_workers=NUM_WORKERS)
    runs: list[dict[str, Any]] = []
    alone_pct: list[float] = []
    shared_pct: list[float] = []
    for seed in seeds:
        alone = run_day(spec, day, with_batch=False, seed=seed)
        shared = run_day(spec, day, with_batch=True, seed=seed)
        alone_pct.append(100 * attainment(alone.online))
        shared_pct.append(100 * attainment(shared.online))
        runs.append({
            "seed": seed,
            "online_requests": len(alone.online),
            "attainment_pct_alone": alone_pct[-1],
            "attainment_pct_with_batch": shared_pct[-1],
            "batch_lines_ok": sum(1 for r in shared.batch if r.error is None),
            "batch_done_s": shared.batch_done_s,
            "batch_took_s": (None if shared.batch_done_s is None
                             else shared.batch_done_s - day.submitted_at_s),
        })  # fmt: skip
    paired = [b - a for a, b in zip(alone_pct, shared_pct, strict=True)]
    diff = _spread(paired)
    stderr = diff["sd"] / len(paired) ** 0.5
    took = [r["batch_took_s"] for r in runs]
    return {
        "runs": runs,
        "alone_pct": _spread(alone_pct),
        "with_batch_pct": _spread(shared_pct),
        "paired_difference_pts": diff,
        "paired_difference_stderr_pts": stderr,
        "seeds_lower_with_batch": sum(1 for d in paired if d < 0),
        "within_noise": abs(diff["mean"]) <= 2 * stderr and min(shared_pct) >= min(alone_pct),
        "batch_took_s": None if None in took else _spread(took),
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
    max_in_flight: int,
    seed: int,
    *,
    with_batch: bool,
    counts_batch: bool = False,
    base: BatchDay = DAY,
) -> PlannedDay:
    """The day on the planner's replicas, `max_in_flight` batch lines at once."""
    day = dataclasses.replace(base, max_in_flight=max_in_flight)
    spec = ClusterSpec(PROFILE, num_workers=NUM_WORKERS)
    return run_planned_day(spec, day, planner(), startup_s=STARTUP_S, slo=SLO,
                           with_batch=with_batch, seed=seed,
                           counts_batch=counts_batch)  # fmt: skip


def planner_arms(max_in_flight: int, seed: int, base: BatchDay = DAY) -> PlannerArms:
    return PlannerArms(
        planned(max_in_flight, seed, with_batch=False, base=base),
        planned(max_in_flight, seed, with_batch=True, base=base),
        planned(max_in_flight, seed, with_batch=True, counts_batch=True, base=base),
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="kvflow sim batch-day",
                                description="A batch at the day's peak, in virtual time: "
                                "online SLO attainment over seeds, and the planner's "
                                "replicas with and without the batch.")  # fmt: skip
    p.add_argument("--json", help="write the report here")
    p.add_argument("--seeds", type=int, default=10, help="seeds 0..N-1 for the noise")
    p.add_argument("--planner-seed", type=int, default=3)
    p.add_argument("--planner-in-flight", type=positive_int, nargs="+", default=[4, 16],
                   help="batch lines in flight at once, one planner run each")  # fmt: skip
    p.add_argument("--tpot-headroom-fraction", type=float,
                   default=DEFAULT_TPOT_HEADROOM_FRACTION, metavar="F",
                   help="share of the online TPOT target a worker's decode step may reach "
                   "with a batch line added, above 0 to 1; 0: lines wait for queues only "
                   "(default: %(default)s)")  # fmt: skip
    return p


def main(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = parser().parse_args(argv)
    if args.seeds < 2:
        print("--seeds: at least 2, for a spread", file=err)
        return 2
    if not 0 <= args.tpot_headroom_fraction <= 1:
        print("--tpot-headroom-fraction: 0 to 1", file=err)
        return 2
    fraction = args.tpot_headroom_fraction
    headroom = TpotHeadroom(SLO.tpot_s, fraction) if fraction > 0 else None
    day = dataclasses.replace(DAY, tpot_headroom=headroom)
    report: dict[str, Any] = {
        "scenario": {
            "day_s": DAY_S, "peak_rate_per_s": TRAFFIC.peak_rate_per_s,
            "batch_lines": DAY.num_lines, "batch_submitted_at_s": DAY.submitted_at_s,
            "batch_max_in_flight": DAY.max_in_flight, "workers": NUM_WORKERS,
            "tpot_headroom_fraction": fraction,
            "slo": {"ttft_s": SLO.ttft_s, "tpot_s": SLO.tpot_s},
            "planner": {"interval_s": PLANNER_INTERVAL_S, "startup_s": STARTUP_S,
                        "stabilization_s": STABILIZATION_S},
        },
        "noise": noise(range(args.seeds), day),
        "planner": {},
    }  # fmt: skip
    n = report["noise"]
    print(f"online attainment over {args.seeds} seeds, % (mean, sd, min-max):", file=out)
    for key in ("alone_pct", "with_batch_pct", "paired_difference_pts"):
        s = n[key]
        print(f"  {key}: {s['mean']:.2f} sd {s['sd']:.2f} [{s['min']:.2f}, {s['max']:.2f}]",
              file=out)  # fmt: skip
    print(f"  paired difference's standard error {n['paired_difference_stderr_pts']:.3f} pts; "
          f"lower with the batch on {n['seeds_lower_with_batch']} of {args.seeds} seeds; "
          f"within noise: {n['within_noise']}", file=out)  # fmt: skip
    took = n["batch_took_s"]
    if took is not None:
        print(
            f"  the batch took {took['mean']:.0f} s (min {took['min']:.0f}, max "
            f"{took['max']:.0f}) of its {DAY.window_s:.0f} s window",
            file=out,
        )
    else:
        print("  the batch did not complete on every seed", file=out)
    for in_flight in args.planner_in_flight:
        arms = planner_arms(in_flight, args.planner_seed, day)
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
