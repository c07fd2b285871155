# Sourced by bench/gpu_check.sh and bench/gpu_tests.sh: the interpreter and the import path
# on a GPU machine, which has python3 with torch (CUDA), transformers, numpy, safetensors
# and pytest, and reaches no registry: nothing is installed, no venv is made. kvflow runs
# from its source roots on PYTHONPATH (no `pip install -e`, which would need setuptools from
# the network for its build). Wheels carried in .whl/ (what the machine lacks, e.g. from
# `pip download`) are unpacked into /tmp/kvflow-site first.
# Sets PY; returns 2 if the wheels cannot be unpacked.
PY=${PYTHON:-}
if [ -z "$PY" ]; then
  if [ -x .venv/bin/python ]; then PY=.venv/bin/python; else PY=python3; fi
fi
if compgen -G ".whl/*.whl" >/dev/null; then
  "$PY" -m pip install -q --no-index --no-deps --no-compile --no-cache-dir --upgrade \
    --target /tmp/kvflow-site .whl/*.whl || return 2
  export PYTHONPATH=/tmp/kvflow-site${PYTHONPATH:+:$PYTHONPATH}
fi
export PYTHONPATH=bench:proto:engine_worker${PYTHONPATH:+:$PYTHONPATH}
