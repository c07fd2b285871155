"""The llama.cpp vs kvflow table, pure: from `kvflow bench` JSON reports (schema
`kvflow-bench/1`) of interleaved runs to one row per server and concurrency (the median
over runs, and the spread of throughput) and kvflow's ratio to llama.cpp.

Throughput is the closed loop's served rate by Little's law, users x output tokens per
request / mean E2E (no think time), not `kvflow bench`'s `output_tokens_per_s`: that one
counts the requests sent inside the measured window over the time until the last of them
ends, so when a request's E2E is as long as the window (a server that queues 32 users
behind one slot: 28 s) the window stretches and the rate reads a third of what the
server did. Both agree where E2E is short (1 user: equal to 0.1 tok/s); both are kept.

    python bench/llamacpp_report.py out/bench/llamacpp.json    # re-render a saved run
"""

from __future__ import annotations

import statistics
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass
from typing import Any

SERVERS = ("llama.cpp", "kvflow", "kvflow-widened")


@dataclass(frozen=True)
class Row:
    server: str
    users: int
    runs: int
    served_tokens_per_s: float | None  # median over runs of users x tokens / mean E2E
    served_tokens_per_s_min: float | None
    served_tokens_per_s_max: float | None
    bench_tokens_per_s: float  # median of kvflow bench's windowed output_tokens_per_s
    e2e_mean_s: float | None
    ttft_p50_ms: float | None
    ttft_p90_ms: float | None
    itl_p50_ms: float | None
    itl_p90_ms: float | None
    mean_output_tokens: float | None
    num_ok: int  # summed over runs
    num_errors: int


def _median(values: Sequence[float | None]) -> float | None:
    present = [v for v in values if v is not None]
    return statistics.median(present) if present else None


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000.0


def _served(users: int, thr: Mapping[str, Any], lat: Mapping[str, Any]) -> float | None:
    tokens, e2e_s = thr["mean_output_tokens"], lat["e2e_s"]["mean"]
    if tokens is None or not e2e_s:
        return None
    return float(users * tokens / e2e_s)


def rows(runs: Sequence[tuple[str, Mapping[str, Any]]]) -> list[Row]:
    """``runs``: (server, report) pairs; each report's load points are closed-loop users."""
    points: dict[tuple[str, int], list[Mapping[str, Any]]] = {}
    for server, report in runs:
        for point in report["load_points"]:
            points.setdefault((server, int(point["value"])), []).append(point)
    out = []
    for (server, users), found in sorted(
        points.items(), key=lambda kv: (kv[0][1], SERVERS.index(kv[0][0]))
    ):
        lat = [p["latency"] for p in found]
        thr = [p["throughput"] for p in found]
        served = [_served(users, t, x) for t, x in zip(thr, lat, strict=True)]
        present = [v for v in served if v is not None]
        out.append(
            Row(
                server=server,
                users=users,
                runs=len(found),
                served_tokens_per_s=_median(served),
                served_tokens_per_s_min=min(present) if present else None,
                served_tokens_per_s_max=max(present) if present else None,
                bench_tokens_per_s=statistics.median(float(t["output_tokens_per_s"]) for t in thr),
                e2e_mean_s=_median([x["e2e_s"]["mean"] for x in lat]),
                ttft_p50_ms=_ms(_median([x["ttft_s"]["p50"] for x in lat])),
                ttft_p90_ms=_ms(_median([x["ttft_s"]["p90"] for x in lat])),
                itl_p50_ms=_ms(_median([x["itl_s"]["p50"] for x in lat])),
                itl_p90_ms=_ms(_median([x["itl_s"]["p90"] for x in lat])),
                mean_output_tokens=_median([t["mean_output_tokens"] for t in thr]),
                num_ok=sum(int(t["num_ok"]) for t in thr),
                num_errors=sum(sum(t["errors"].values()) for t in thr),
            )
        )
    return out


def _ratio(num: float | None, den: float | None) -> float | None:
    if num is None or den is None or den == 0:
        return None
    return num / den


def ratios(table: Sequence[Row], server: str = "kvflow") -> dict[int, dict[str, float | None]]:
    """Per concurrency, ``server`` / llama.cpp: above 1 is more throughput, or a longer wait."""
    by_key = {(r.server, r.users): r for r in table}
    out: dict[int, dict[str, float | None]] = {}
    for users in sorted({r.users for r in table}):
        k, ll = by_key.get((server, users)), by_key.get(("llama.cpp", users))
        if k is None or ll is None:
            continue
        out[users] = {
            "served_tokens_per_s": _ratio(k.served_tokens_per_s, ll.served_tokens_per_s),
            "ttft_p50": _ratio(k.ttft_p50_ms, ll.ttft_p50_ms),
            "ttft_p90": _ratio(k.ttft_p90_ms, ll.ttft_p90_ms),
            "itl_p50": _ratio(k.itl_p50_ms, ll.itl_p50_ms),
            "itl_p90": _ratio(k.itl_p90_ms, ll.itl_p90_ms),
        }
    return out


def _f(value: float | None, digits: int = 1) -> str:
    return "-" if value is None else f"{value:.{digits}f}"


def render(table: Sequence[Row]) -> str:
    header = (
        "| users | server | served tok/s (min-max) | bench tok/s | TTFT P50 ms | P90 "
        "| ITL P50 ms | P90 | E2E mean s | out tok/req | ok | errors |"
    )
    lines = [header, "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in table:
        lines.append(
            f"| {r.users} | {r.server} | {_f(r.served_tokens_per_s)} "
            f"({_f(r.served_tokens_per_s_min)}-{_f(r.served_tokens_per_s_max)}) "
            f"| {_f(r.bench_tokens_per_s)} | {_f(r.ttft_p50_ms)} | {_f(r.ttft_p90_ms)} "
            f"| {_f(r.itl_p50_ms)} | {_f(r.itl_p90_ms)} | {_f(r.e2e_mean_s, 2)} "
            f"| {_f(r.mean_output_tokens)} | {r.num_ok} | {r.num_errors} |"
        )
    lines += [
        "",
        "kvflow / llama.cpp (throughput: above 1 is kvflow faster; latency: above 1 "
        "is kvflow slower)",
        "",
        "| users | kvflow arm | served tok/s | TTFT P50 | TTFT P90 | ITL P50 | ITL P90 |",
        "|---|---|---|---|---|---|---|",
    ]
    for server in _kvflow_arms(table):
        for users, ratio in ratios(table, server).items():
            cells = " | ".join(
                _f(ratio[k], 2)
                for k in ("served_tokens_per_s", "ttft_p50", "ttft_p90", "itl_p50", "itl_p90")
            )
            lines.append(f"| {users} | {server} | {cells} |")
    return "\n".join(lines)


def _kvflow_arms(table: Sequence[Row]) -> list[str]:
    return sorted({r.server for r in table} - {"llama.cpp"})


def as_json(table: Sequence[Row]) -> dict[str, Any]:
    return {
        "rows": [asdict(r) for r in table],
        "ratios_kvflow_over_llamacpp": {str(u): r for u, r in ratios(table).items()},
        "ratios_over_llamacpp": {
            server: {str(u): r for u, r in ratios(table, server).items()}
            for server in _kvflow_arms(table)
        },
    }


if __name__ == "__main__":
    import json
    import sys
    from pathlib import Path

    saved = json.loads(Path(sys.argv[1]).read_text())
    print(render(rows([(r["server"], r["report"]) for r in saved["runs"]])))
