#!/usr/bin/env bash
# The GPU check (docs/benchmarks.md, "GPU check"): set up what the machine lacks, then run
# bench/gpu_check.py with the arguments given (--dry-run: the CPU mode CI runs).
#
# The device machine (/work/.library/device/KINDS.md) has python3 with torch (CUDA),
# transformers, numpy and safetensors, and reaches no registry: nothing is installed, no
# venv is made. kvflow runs from its source roots on PYTHONPATH (no `pip install -e`,
# which would need setuptools from the network for its build). Wheels carried in .whl/
# (the device README's recipe) are unpacked into /tmp/kvflow-site first.
set -uo pipefail
cd "$(dirname "$0")/.."
t0=$(date +%s.%N)

PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvflow-site .whl/*.whl || exit 2
  export PYTHONPATH=/tmp/kvflow-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=bench:proto:engine_worker${PYTHONPATH:+:$PYTHONPATH}

"$PY" - <<'PYEOF' || exit 2
import importlib.util, sys
need = ["torch", "numpy", "transformers"]
missing = [m for m in need if importlib.util.find_spec(m) is None]
if missing:
    sys.exit(f"gpu_check: {sys.executable} lacks {', '.join(missing)}: carry them as wheels in "
             ".whl/ (see /work/.library/device/README.md) or set PYTHON to an interpreter with them")
import kvflow.engine_worker.runner  # the source roots resolve
PYEOF

setup_s=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.1f", b - a }')
echo "[gpu_check] setup: ${setup_s} s with $("$PY" --version 2>&1)"
exec "$PY" bench/gpu_check.py --setup-s "$setup_s" "$@"
