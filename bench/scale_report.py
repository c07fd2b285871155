"""The scale check's summary against its targets, and its terminal report."""

from __future__ import annotations

import argparse
from typing import Any

from scale_metrics import Histogram, trend


def percentile_ms(values_s: list[float], q: float) -> float:
    ordered = sorted(values_s)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] * 1e3 if ordered else float("nan")


def summarize(run: dict[str, Any], args: argparse.Namespace) -> dict[str, Any]:
    h = run["measured_histogram"]
    measured = Histogram(tuple(h["bounds_s"]), tuple(h["cumulative"]), h["sum_s"])
    samples = [s for s in run["samples"] if not s["is_warmup"]]
    second_half = [s for s in samples if s["t_s"] >= args.warmup_s + args.duration_s / 2]
    if len(second_half) < 2:
        second_half = samples[-2:]
    times = [s["t_s"] for s in second_half]
    rss = trend(times, [s["gateway_rss_mib"] for s in second_half])
    index = trend(times, [s["index_blocks"] for s in second_half])
    capacity = args.workers * args.num_kv_blocks
    traffic = run["traffic"]
    done_in_half = second_half[-1]["num_requests_done"] - second_half[0]["num_requests_done"]
    stored_in_half = second_half[-1]["num_blocks_stored"] - second_half[0]["num_blocks_stored"]
    decision = {
        "p50_ms": measured.quantile_s(0.5) * 1e3,
        "p99_ms": measured.quantile_s(0.99) * 1e3,
        "mean_ms": measured.mean_s * 1e3,
        "share_at_most_1ms": measured.fraction_at_most(0.001),
        "share_at_most_5ms": measured.fraction_at_most(0.005),
        "num_decisions": measured.count,
    }
    index_max = max(s["index_blocks"] for s in run["samples"])
    worker_peak = max(s["worker_cached_blocks"] for s in run["samples"])
    rss_bytes_per_request = rss.growth * 2**20 / done_in_half if done_in_half else float("nan")
    achieved = len(traffic.latencies_s) / args.duration_s
    delay_p99_ms = percentile_ms(traffic.delays_s, 0.99)
    # Valid: every request scheduled after warm-up answered, and the generator kept its
    # schedule (Poisson counts vary, so the achieved rate is reported, not judged).
    is_valid = (
        len(traffic.latencies_s) == traffic.num_measured_sent
        and delay_p99_ms < 50
        and not traffic.errors
    )
    return {
        "stages": run.get("stages"),
        "decision": decision,
        "index": {"max_blocks": index_max, "capacity_blocks": capacity,
                  "second_half_slope_per_min": index.slope_per_min,
                  "last_blocks": index.last,
                  "last_worker_cached_blocks": run["samples"][-1]["worker_cached_blocks"],
                  "peak_worker_cached_blocks": worker_peak,
                  "second_half_growth_blocks": index.growth,
                  "second_half_blocks_stored": stored_in_half},
        "gateway_rss": {"first_mib": run["samples"][0]["gateway_rss_mib"],
                        "second_half_first_mib": rss.first, "last_mib": rss.last,
                        "peak_mib": max(s["gateway_rss_mib"] for s in run["samples"]),
                        "second_half_growth_mib": rss.growth,
                        "second_half_slope_mib_per_min": rss.slope_per_min,
                        "second_half_bytes_per_request": rss_bytes_per_request},
        "traffic": {"target_rate": args.rate, "achieved_rate": achieved,
                    "schedule_delay_p99_ms": delay_p99_ms,
                    "latency_p50_ms": percentile_ms(traffic.latencies_s, 0.5),
                    "latency_p99_ms": percentile_ms(traffic.latencies_s, 0.99),
                    "num_sent": traffic.num_sent, "errors": traffic.errors,
                    "is_valid": is_valid},
        "targets": {
            "decision_p50_under_1ms": decision["share_at_most_1ms"] >= 0.5,
            "decision_p99_under_5ms": decision["share_at_most_5ms"] >= 0.99,
            # Bounded, and shown to be: the index never held more than the workers can, at
            # the end no more than they report, and in the second half it grew by under 5 %
            # of the blocks the workers stored meanwhile (so it followed their evictions).
            "index_bounded": index_max <= capacity
            and index.last <= run["samples"][-1]["worker_cached_blocks"]
            and index.growth <= 0.05 * stored_in_half,
            # Flat: the second half adds under 1 % of the RSS; a leak of 100 bytes a request
            # at 30 req/s over 5 minutes would add 0.9 MB, about 0.5 %.
            "rss_flat": rss.growth < 0.01 * rss.first,
        },
    }  # fmt: skip


def print_report(summary: dict[str, Any], args: argparse.Namespace) -> None:
    d, i, r, t = (summary[k] for k in ("decision", "index", "gateway_rss", "traffic"))
    print(f"\nscale check: {args.workers} simulated workers on {args.hosts} hosts, "
          f"{args.duration_s:.0f} s after {args.warmup_s:.0f} s warm-up")  # fmt: skip
    print(f"  traffic: {t['achieved_rate']:.1f}/s of {t['target_rate']:.0f}/s, schedule delay "
          f"p99 {t['schedule_delay_p99_ms']:.1f} ms, latency p50 {t['latency_p50_ms']:.0f} ms "
          f"p99 {t['latency_p99_ms']:.0f} ms, errors {t['errors'] or 0}, "
          f"{'valid' if t['is_valid'] else 'INVALID'}")  # fmt: skip
    print(
        f"  routing decision: p50 {d['p50_ms']:.3f} ms, p99 {d['p99_ms']:.3f} ms, mean "
        f"{d['mean_ms']:.3f} ms; {100 * d['share_at_most_1ms']:.2f} % <= 1 ms, "
        f"{100 * d['share_at_most_5ms']:.2f} % <= 5 ms ({d['num_decisions']:.0f} decisions)"
    )
    print(f"  KV index: max {i['max_blocks']:.0f} blocks (capacity of the workers "
          f"{i['capacity_blocks']}), last {i['last_blocks']:.0f} vs the workers' "
          f"{i['last_worker_cached_blocks']}; second half {i['second_half_growth_blocks']:+.0f}"
          f" blocks while the workers stored about {i['second_half_blocks_stored']}")  # fmt: skip
    print(f"  gateway RSS: {r['first_mib']:.1f} MiB at start, {r['second_half_first_mib']:.1f} "
          f"at half time, {r['last_mib']:.1f} at the end (peak {r['peak_mib']:.1f}); second "
          f"half {r['second_half_growth_mib']:+.1f} MiB, "
          f"{r['second_half_slope_mib_per_min']:+.2f} MiB/min, "
          f"{r['second_half_bytes_per_request']:+.0f} bytes/request")  # fmt: skip
    stages = summary.get("stages")
    if stages:
        print("  instrumented gateway (ms):")
        for k, v in stages.items():
            if k.startswith(("routing_decision", "gc_pause")):
                print(f"    {k:<22} p50 {v['p50_ms']:.3f}  p99 {v['p99_ms']:.3f}  max "
                      f"{v['max_ms']:.1f}  n {v['n']}")  # fmt: skip
    alive = (stages or {}).get("allocations_alive_at_exit")
    if alive:
        print(f"  allocated after warm-up, alive at the end: {alive['total_kib']:.0f} KiB; top:")
        for a in alive["top"]:
            print(f"    {a['kib']:8.0f} KiB {a['count']:7d} blocks  {a['where']}")
    if stages and stages.get("sizes_at_exit"):
        print(f"  tables at exit: {stages['sizes_at_exit']}")
    print("  targets: " + ", ".join(f"{k} {'met' if v else 'NOT met'}"
                                    for k, v in summary["targets"].items()))  # fmt: skip
