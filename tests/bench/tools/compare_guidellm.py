"""Compare guidellm's and `kvflow bench`'s TTFT and TPOT percentiles from their JSON files.

guidellm's ``inter_token_latency_ms`` is (T_last - T_first) / (O - 1) per request, weighted
by tokens; with every request at the same output length that is kvflow's TPOT
distribution. Used by docs/bench.md's cross-check:

    python tests/bench/tools/compare_guidellm.py guidellm.json kvflow.json
"""

from __future__ import annotations

import json
import sys

PAIRS = (("TTFT", "time_to_first_token_ms", "ttft_s"), ("TPOT", "inter_token_latency_ms", "tpot_s"))


def main() -> None:
    with open(sys.argv[1]) as f:
        guide = json.load(f)["benchmarks"][0]["metrics"]
    with open(sys.argv[2]) as f:
        ours = json.load(f)["load_points"][0]
    print(f"requests: guidellm {guide['request_totals']['successful']}, "
          f"kvflow bench {ours['throughput']['num_ok']}")  # fmt: skip
    for label, guide_name, our_name in PAIRS:
        for p in ("p50", "p90", "p99"):
            theirs_ms = guide[guide_name]["successful"]["percentiles"][p]
            ours_ms = ours["latency"][our_name][p] * 1e3
            diff = 100 * (ours_ms - theirs_ms) / theirs_ms
            print(f"{label} {p}: guidellm {theirs_ms:6.1f} ms, kvflow bench {ours_ms:6.1f} ms "
                  f"({diff:+.1f} %)")  # fmt: skip


if __name__ == "__main__":
    main()
