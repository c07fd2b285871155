"""The gateway benchmark's terminal report (the JSON holds the same and more)."""

from __future__ import annotations

from typing import Any

STAGE_ORDER = ("handler", "authenticate", "read_body", "template_and_tokenize", "quota_admit",
               "collect", "routing_decision", "worker_stream", "quota_settle")  # fmt: skip


def _validity(a: dict[str, Any]) -> str:
    return "valid" if a["is_valid"] else "INVALID"


def print_report(r: dict[str, Any]) -> None:
    d = r["decision"]
    print(
        f"\nrouting decision, {d['prompt_tokens']}-token prompts, {d['num_workers']} workers (ms)"
    )
    for kind in ("cached", "three_quarters_cached", "cold", "cached_without_hash_memo"):
        s = d[kind]
        print(f"  {kind:<26} p50 {s['p50_ms']:7.3f}  p99 {s['p99_ms']:7.3f}")
    print(f"\nlatency at {r['settings']['rate']:.0f} req/s, 16 output tokens (ms); CPU ms per "
          "request by process")  # fmt: skip
    for arm, a in r["arms"].items():
        lat, delay = a["latency"], a["schedule_delay"]
        cpu = "  ".join(f"{k} {v:.2f}" for k, v in a["cpu_ms_per_request"].items())
        print(f"  {arm:<28} p50 {lat['p50_ms']:6.2f}  p90 {lat['p90_ms']:6.2f}"
              f"  p99 {lat['p99_ms']:6.2f}  {a['achieved_rate']:5.1f}/s"
              f"  sched p99 {delay['p99_ms']:5.2f}  {_validity(a)}  cpu: {cpu}")  # fmt: skip
    print("added to direct (ms):")
    for arm, added in r["added_ms"].items():
        print(f"  {arm:<28} p50 {added['p50_ms']:6.2f}  p90 {added['p90_ms']:6.2f}"
              f"  p99 {added['p99_ms']:6.2f}")  # fmt: skip
    print(f"\nthroughput, 1-token answers, {r['settings']['concurrency']} clients (closed loop):")
    direct = r["arms"]["direct"].get("throughput_closed_loop")
    for arm, a in r["arms"].items():
        if "throughput_closed_loop" not in a:
            continue
        t = a["throughput_closed_loop"]
        line = f"  {arm:<28} {t:6.0f}/s ({t / direct:.2f}x direct)"
        c = a.get("target_rate_check")
        if c:
            line += (f"; open loop at {c['target_rate']:.0f}/s: {c['achieved_rate']:.1f}/s, "
                     f"p50 {c['latency']['p50_ms']:.2f} ms, p99 {c['latency']['p99_ms']:.2f} ms, "
                     f"{_validity(c)}")  # fmt: skip
        print(line)
    stages = r.get("stages")
    if stages:
        print("\nwhere the time goes: tenants-redis, wall time per request stage (ms)")
        for stage in STAGE_ORDER:
            if stage in stages:
                s = stages[stage]
                print(f"  {stage:<22} p50 {s['p50_ms']:6.3f}  p90 {s['p90_ms']:6.3f}  p99 "
                      f"{s['p99_ms']:6.3f}  mean {s['mean_ms']:6.3f}  n {s['n']}")  # fmt: skip


def print_paired(paired: dict[str, Any]) -> None:
    if not paired:
        return
    print("\nadded latency per request (gateway time - direct time of the same request), ms")
    print(f"{'arm':<26} {'idle P50':>9} {'P90':>7} {'P99':>7}   {'loaded P50':>10} {'P90':>7} "
          f"{'P99':>7} {'errors':>6}")  # fmt: skip
    for name, r in paired.items():
        i, lo = r["idle_added"], r["loaded_added"]
        print(f"{name:<26} {i['p50_ms']:>9.2f} {i['p90_ms']:>7.2f} {i['p99_ms']:>7.2f}   "
              f"{lo['p50_ms']:>10.2f} {lo['p90_ms']:>7.2f} {lo['p99_ms']:>7.2f} "
              f"{r['loaded_errors']:>6}")  # fmt: skip
