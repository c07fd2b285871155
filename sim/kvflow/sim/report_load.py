"""Comparison results read back from `kvflow sim compare --json` reports (single-seed
ones, or the ``runs`` of a report over seeds), so seeds run apart (one process each, or
on other machines) are summarised together (`--seeds-from`). Only the report's own
numbers come back: the per-worker statistics are not in it."""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import replace
from pathlib import Path
from typing import Any

from kvflow.engine_worker.sim.profile_file import resolve_profile
from kvflow.loadgen.metrics import LatencySummary, Percentiles, Slo, ThroughputSummary
from kvflow.loadgen.summary import CacheSummary, LoadPointSummary, ScheduleSummary
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.compare import ArmLadder, ComparisonConfig, ComparisonResult
from kvflow.sim.report import SCHEMA as SINGLE_SEED_SCHEMA
from kvflow.sim.seeds_report import SCHEMA as SEEDS_SCHEMA


class ReportError(ValueError):
    """A file that is not a single-seed comparison report, or reports that disagree."""


def summary_from_dict(d: Mapping[str, Any]) -> LoadPointSummary:
    """The inverse of ``loadgen.report_json.point_dict``."""
    lat, sched = d["latency"], d["schedule"]
    return LoadPointSummary(
        label=d["label"], kind=d["kind"], value=d["value"], num_warmup=d["num_warmup"],
        latency=LatencySummary(
            Percentiles(**lat["ttft_s"]), Percentiles(**lat["tpot_s"]),
            Percentiles(**lat["itl_s"]), Percentiles(**lat["e2e_s"]),
            lat["ttft_p90_with_failures_s"],
        ),
        throughput=ThroughputSummary(**d["throughput"]),
        schedule=ScheduleSummary(
            sched["offered_rate_per_s"], sched["scheduled_rate_per_s"],
            sched["achieved_rate_per_s"], Percentiles(**sched["lag_s"]), sched["is_valid"],
            tuple(sched["problems"]),
        ),
        cache=CacheSummary(**d["cache"]),
        meets_ttft_slo=d["meets_ttft_slo"],
    )  # fmt: skip


def _config(d: Mapping[str, Any]) -> ComparisonConfig:
    return ComparisonConfig(
        trace_path=d["trace_path"], profile=d["profile"], num_workers=d["num_workers"],
        num_kv_blocks=d["num_kv_blocks"], arms=list(d["arms"]),
        workloads=list(d["workloads"]), slo=Slo(**d["slo"]), seed=d["seed"],
        quick=d["quick"], jobs=d["jobs"],
    )  # fmt: skip


def result_from_report(report: Mapping[str, Any]) -> ComparisonResult:
    config = _config(report["config"])
    spec = ClusterSpec(resolve_profile(config.profile), num_workers=config.num_workers,
                       num_kv_blocks=config.num_kv_blocks)  # fmt: skip
    result = ComparisonResult(config, spec)
    for item in report["ladders"]:
        points = [summary_from_dict(p) for p in item["load_points"]]
        result.ladders.append(ArmLadder(item["workload"], item["arm"], points, [],
                                        item.get("wall_s", 0.0),
                                        item.get("floor_ttft_p90_s", [])))  # fmt: skip
    return result


def _cluster(config: ComparisonConfig) -> tuple[object, ...]:
    return (config.profile, config.num_workers, config.num_kv_blocks, config.slo, config.quick)


def merge_by_seed(results: Sequence[ComparisonResult]) -> list[tuple[int, ComparisonResult]]:
    """One result per seed, in seed order: the ladders of every report of that seed (a
    later report's ladder replaces an earlier one's for the same workload and arm). All
    reports must share the cluster, the SLO and ``--quick``."""
    if not results:
        raise ReportError("no reports")
    first = results[0].config
    merged: dict[int, ComparisonResult] = {}
    for result in results:
        config = result.config
        if _cluster(config) != _cluster(first):
            raise ReportError(
                f"reports disagree on the cluster, SLO or --quick: {_cluster(config)} vs "
                f"{_cluster(first)}"
            )
        into = merged.setdefault(config.seed, ComparisonResult(config, result.spec))
        keep = {(r.workload, r.arm) for r in result.ladders}
        into.ladders = [r for r in into.ladders if (r.workload, r.arm) not in keep]
        into.ladders += result.ladders
        workloads = dict.fromkeys([*into.config.workloads, *config.workloads])
        arms = dict.fromkeys([*into.config.arms, *config.arms])
        into.config = replace(into.config, workloads=list(workloads), arms=list(arms))
    return sorted(merged.items())


def load_results(paths: Sequence[str | Path]) -> list[ComparisonResult]:
    out = []
    for path in paths:
        try:
            report = json.loads(Path(path).read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ReportError(f"{path}: {exc}") from None
        schema = report.get("schema") if isinstance(report, dict) else None
        if schema not in (SINGLE_SEED_SCHEMA, SEEDS_SCHEMA):
            raise ReportError(f"{path}: not a `kvflow sim compare --json` report (schema "
                              f"{SINGLE_SEED_SCHEMA} or {SEEDS_SCHEMA})")  # fmt: skip
        # A report over seeds keeps each seed's whole report.
        reports = report["runs"] if schema == SEEDS_SCHEMA else [report]
        try:
            out += [result_from_report(r) for r in reports]
        except (KeyError, TypeError) as exc:
            raise ReportError(f"{path}: malformed report ({exc!r})") from None
    return out
