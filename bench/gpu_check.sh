#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md, "GPU check"): set up what the machine lacks, then run
# bench/gpu_check.py with the arguments given (--dry-run: the CPU mode CI runs).
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s.%N)
source bench/gpu_env.sh || exit 2

"$PY" - <<'PYEOF' || exit 2
import importlib.util, sys
need = ["torch", "numpy", "transformers"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: {sys.executable} lacks {', '.join(missing)}: carry them as wheels in "
             ".whl/ or set PYTHON to an interpreter with them")
import kvflow.engine_worker.runner  # the source roots resolve
PYEOF

setup_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "[gpu_check] setup: ${setup_s} s with $("$PY" --version 2>&1)"
exec "$PY" bench/gpu_check.py --setup-s "$setup_s" "$@"
