"""How much the routing comparison's max/mean load moves on noise at one rung.

The shared-prefix ladder measures 600 requests per rung. Over 8 workers that is about 75
each, so max/mean moves by about 0.1 between seeds even for the ideal arm. This runs the
80 req/s rung (the first past the default router's knee) for an arm at seeds 0-2 with the
ladder's 600 requests, and at seed 0 with 2,400, in virtual time, and prints one JSON line
per run.

    python bench/routing_balance_noise.py kvflow ideal      # about 30 min on 2 busy cores
"""

from __future__ import annotations

import json
import sys

from kvflow.engine_worker.sim.profile_file import resolve_profile
from kvflow.loadgen.arrivals import ArrivalKind, LoadPoint
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.sim.arms import resolve_arm
from kvflow.sim.cluster import ClusterSpec
from kvflow.sim.compare import SHARED_PREFIX_RATES
from kvflow.sim.ladders import SimLadder
from kvflow.sim.run import run_point

RATE_PER_S = 80
WARMUP_REQUESTS = 1200  # as the ladder: twice the measured 600


def main(arms: list[str]) -> None:
    spec = ClusterSpec(resolve_profile("h100-llama3-8b"), num_workers=8)
    point = LoadPoint(ArrivalKind.POISSON, RATE_PER_S)
    index = list(SHARED_PREFIX_RATES).index(RATE_PER_S)  # the ladder's request namespace
    workload = SharedPrefixWorkload(300, 5, (6000,), 1200, 100)  # the ladder's
    for arm in arms:
        for seed, measured in ((0, 600), (0, 2400), (1, 600), (2, 600)):
            ladder = SimLadder(
                "shared-prefix", workload, [point], Slo(1.0, 0.1), seed,
                warmup_requests=WARMUP_REQUESTS, measured_requests=measured,
            )  # fmt: skip
            result = run_point(spec, resolve_arm(arm), ladder.plan_for(point), point, index)
            cache = result.summary.cache
            print(json.dumps({"arm": arm, "seed": seed, "measured_requests": measured,
                              "max_over_mean": round(cache.load_imbalance or 0, 3),
                              "hit_rate": round(cache.hit_rate or 0, 3)}), flush=True)  # fmt: skip


if __name__ == "__main__":
    main(sys.argv[1:] or ["kvflow", "ideal"])
