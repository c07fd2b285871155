#!/bin/bash
# The engine's throughput before and after a change, in separate processes, alternating:
# one kvflow run of bench/engine_throughput.py's full workload per side and round.
#
#   bash bench/engine_before_after.sh BEFORE_COMMIT OUT_DIR [ROUNDS] [MODELS]
#
# BEFORE_COMMIT is checked out in a scratch worktree and run from its source roots; the
# "after" side is this checkout. Each run writes OUT_DIR/{before,after}-N.json. Changes
# that act over a whole run (memory growth, allocation) show here and not in
# bench/engine_ab.py, which alternates single steps in one process.
set -euo pipefail
before=${1:?usage: engine_before_after.sh BEFORE_COMMIT OUT_DIR [ROUNDS] [MODELS]}
out=$(realpath -m "${2:?usage: engine_before_after.sh BEFORE_COMMIT OUT_DIR [ROUNDS] [MODELS]}")
rounds=${3:-3}
models=${4:-tiny,smollm2}
here=$(git rev-parse --show-toplevel)
tree=$(mktemp -d)/before
git -C "$here" worktree add -f --detach "$tree" "$before" > /dev/null
trap 'git -C "$here" worktree remove --force "$tree"' EXIT
mkdir -p "$out"
roots=proto:engine_worker:router:operator:sim:loadgen:cli
for i in $(seq 1 "$rounds"); do
  for side in before after; do
    dir=$tree; [ "$side" = after ] && dir=$here
    echo "round $i, $side ($dir)"
    (cd "$dir" && PYTHONPATH=$roots python bench/engine_throughput.py --models "$models" \
      --arms kvflow --runs 1 --no-ttft --json "$out/$side-$i.json" 2>&1 | grep -E "run 1: kvflow")
  done
done
python - "$out" "$rounds" <<'PY'
import json, statistics, sys
out, rounds = sys.argv[1], int(sys.argv[2])
def tps(side):
    per = {}
    for i in range(1, rounds + 1):
        for m in json.load(open(f"{out}/{side}-{i}.json"))["models"]:
            per.setdefault(m["model"], []).append(m["summary_tokens_per_s"]["kvflow"]["median"])
    return per
b, a = tps("before"), tps("after")
print("| model | before tok/s (per round) | after | after / before, medians |")
print("|---|---|---|---|")
for model in b:
    fmt = lambda xs: f"{statistics.median(xs):.1f} ({', '.join(f'{x:.1f}' for x in xs)})"
    ratio = statistics.median(a[model]) / statistics.median(b[model])
    print(f"| {model} | {fmt(b[model])} | {fmt(a[model])} | {ratio:.2f}x |")
PY
