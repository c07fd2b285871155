"""Chaos soak from the command line: mixed load through two real gateway replicas to
simulated workers and a real engine worker (built-in SmolLM2-135M), while workers, routers
and Redis are SIGKILLed and restarted at random (tests/chaos/soak.py says what is counted).

    .venv/bin/python bench/chaos_soak.py --duration-s 1800 --seed 1 --out soak.json

Exits 1 when anything whose target is zero was seen (lost, duplicated, hung, a 5xx other
than a clean 503 with Retry-After, leaked KV blocks, usage counted wrong).
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "tests"))

from chaos.soak import SoakConfig, run_soak  # noqa: E402


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--duration-s", type=float, default=120.0,
                   help="chaos time, checkpoints excluded")  # fmt: skip
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--clients", type=int, default=4, help="closed-loop clients")
    p.add_argument("--sim-workers", type=int, default=3)
    p.add_argument("--no-real-worker", action="store_true")
    p.add_argument("--mean-fault-interval-s", type=float, default=4.0)
    p.add_argument("--round-s", type=float, default=300.0, help="chaos time between checkpoints")
    p.add_argument("--out", type=Path, help="write the report as JSON here")
    a = p.parse_args(argv)
    config = SoakConfig(
        duration_s=a.duration_s,
        seed=a.seed,
        num_clients=a.clients,
        num_sim_workers=a.sim_workers,
        with_real_worker=not a.no_real_worker,
        mean_fault_interval_s=a.mean_fault_interval_s,
        round_s=a.round_s,
    )
    with tempfile.TemporaryDirectory(prefix="kvflow-chaos-") as tmp:
        report = run_soak(config, Path(tmp))
    text = json.dumps(report.as_dict(), indent=2)
    if a.out:
        a.out.write_text(text + "\n")
    print(text)
    return 1 if report.bad() else 0


if __name__ == "__main__":
    sys.exit(main())
