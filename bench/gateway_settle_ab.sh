#!/bin/bash
# A/B of the quota settlement (docs/benchmarks.md, "Gateway overhead"): the router before
# 5a62397 (a finish script, then a usage pipeline: two Redis round trips) against the router
# after it (one script), back to back, twice, from two git worktrees:
#   git worktree add /tmp/wt-old 5a62397^ && git worktree add /tmp/wt-new 5a62397
#   flock /tmp/kvflow-bench.lock bench/gateway_settle_ab.sh
set -u
repo="$(cd "$(dirname "$0")/.." && pwd)"
py="${PYTHON:-$repo/.venv/bin/python}"
for round in 1 2; do
  for arm in old new; do
    wt=/tmp/wt-$arm
    cd $wt
    PYTHONPATH=$wt/proto:$wt/engine_worker:$wt/router:$wt/operator:$wt/cli \
      "$py" bench/gateway_overhead.py --arms tenants-redis --stages \
      --json /tmp/gw-$arm-$round.json > /tmp/gw-$arm-$round.log 2>&1
    echo "$arm $round rc=$?"
  done
done
