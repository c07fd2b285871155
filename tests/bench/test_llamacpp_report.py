"""bench/llamacpp_report.py: interleaved `kvflow bench` reports become one row per server
and concurrency (medians, throughput spread) and kvflow's ratios to llama.cpp."""

from __future__ import annotations

from typing import Any

from llamacpp_report import as_json, ratios, render, rows


def _point(
    users: int, e2e_s: float, ttft_s: float, itl_s: float, errors: int = 0, tok_s: float = 1.0
) -> Any:
    return {
        "value": users,
        "latency": {
            "e2e_s": {"mean": e2e_s},
            "ttft_s": {"p50": ttft_s, "p90": 2 * ttft_s},
            "itl_s": {"p50": itl_s, "p90": None},
        },
        "throughput": {
            "output_tokens_per_s": tok_s,
            "mean_output_tokens": 32.0,
            "num_ok": 10,
            "errors": {"timeout": errors} if errors else {},
        },
    }


def _report(*points: Any) -> Any:
    return {"schema": "kvflow-bench/1", "load_points": list(points)}


RUNS = [  # (users, mean E2E s, TTFT P50 s, ITL P50 s): 32 output tokens a request
    ("llama.cpp", _report(_point(1, 1.0, 0.5, 0.025), _point(8, 16.0, 8.0, 0.025))),
    ("kvflow", _report(_point(1, 2.0, 0.25, 0.05), _point(8, 4.0, 1.0, 0.1))),
    ("llama.cpp", _report(_point(1, 0.64, 0.7, 0.035), _point(8, 16.0, 9.0, 0.025, errors=2))),
    ("kvflow", _report(_point(1, 2.0, 0.35, 0.06), _point(8, 4.0, 3.0, 0.1))),
]


def test_served_throughput_is_littles_law_not_the_windowed_rate() -> None:
    # 8 users, 32 tokens each, 16 s mean E2E: 16 tok/s served, whatever the window said.
    (row,) = rows([("llama.cpp", _report(_point(8, 16.0, 15.0, 0.02, tok_s=5.0)))])
    assert row.served_tokens_per_s == 16.0
    assert row.bench_tokens_per_s == 5.0
    assert row.e2e_mean_s == 16.0


def test_rows_take_the_median_over_runs_and_keep_the_spread() -> None:
    table = rows(RUNS)
    assert [(r.users, r.server) for r in table] == [
        (1, "llama.cpp"),
        (1, "kvflow"),
        (8, "llama.cpp"),
        (8, "kvflow"),
    ]
    llama1 = table[0]
    assert llama1.runs == 2
    assert llama1.served_tokens_per_s == 41.0  # 32 / 1.0 s and 32 / 0.64 s
    assert (llama1.served_tokens_per_s_min, llama1.served_tokens_per_s_max) == (32.0, 50.0)
    assert llama1.ttft_p50_ms == 600.0 and llama1.ttft_p90_ms == 1200.0
    assert llama1.itl_p90_ms is None  # not measured in any run: no number, not zero
    assert table[2].num_ok == 20 and table[2].num_errors == 2


def test_ratios_are_kvflow_over_llamacpp() -> None:
    r = ratios(rows(RUNS))
    assert r[1]["served_tokens_per_s"] == 16.0 / 41.0
    assert r[8]["served_tokens_per_s"] == 64.0 / 16.0
    assert r[8]["ttft_p50"] == 2000.0 / 8500.0
    assert r[8]["itl_p90"] is None


def test_render_and_json_carry_every_row() -> None:
    table = rows(RUNS)
    text = render(table)
    assert "| 8 | kvflow | 64.0 (64.0-64.0) | 1.0 | 2000.0 | 4000.0 | 100.0 | - | 4.00 |" in text
    assert "| 8 | kvflow | 4.00 | 0.24 |" in text
    record = as_json(table)
    assert len(record["rows"]) == 4
    assert record["ratios_kvflow_over_llamacpp"]["1"]["served_tokens_per_s"] == 16.0 / 41.0


def test_every_peer_arm_gets_rows_and_ratios() -> None:
    widened = ("kvflow-widened", _report(_point(1, 4.0, 0.5, 0.1), _point(8, 8.0, 2.0, 0.2)))
    table = rows([*RUNS, widened])
    assert [(r.users, r.server) for r in table if r.users == 1] == [
        (1, "llama.cpp"),
        (1, "kvflow"),
        (1, "kvflow-widened"),
    ]
    record = as_json(table)
    assert record["ratios_over_llamacpp"]["kvflow-widened"]["1"]["served_tokens_per_s"] == (
        8.0 / 41.0
    )
    assert "| 1 | kvflow-widened | 0.20 |" in render(table)
