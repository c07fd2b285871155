#!/usr/bin/env bash
# The tests marked `gpu` (pytest -m gpu), on a device machine after bench/gpu_check.sh: by
# default the engine's (CUDA-graph decode steps against the eager CUDA path, over float and
# quantized KV caches; host syncs of a sampling step and of a replayed decode step;
# --gpu-memory-utilization sizing the cache; int4 planes through tinygemm and FP8 weights
# through _scaled_mm against the CPU's products; the paged decode kernel against the gather
# path), about a minute. Name other test files to
# run theirs instead, e.g. tests/bench/test_gpu_check.py (gpu_check --size small, about 2
# minutes). `--list` prints the default files and exits. Everywhere else these tests are
# skipped with their reason. The device image has no `gguf`: none of these files may need
# it (tests/bench/test_gpu_without_gguf.py collects them with it blocked).
set -uo pipefail
cd "$(dirname "$0")/.."
DEFAULT_FILES=(
  tests/engine/test_decode_graphs.py tests/engine/test_sampler.py
  tests/engine/test_auto_dtype.py tests/engine/test_gpu_memory.py
  tests/engine/test_quant_int4_weight.py tests/engine/test_quant_fp8.py
  tests/engine/test_triton_paged_gpu.py
)
if [ "${1:-}" = "--list" ]; then
  printf '%s\n' "${DEFAULT_FILES[@]}"
  exit 0
fi
source bench/gpu_env.sh || exit 2
export PYTHONPATH=tests:$PYTHONPATH
if [ $# -eq 0 ]; then
  set -- "${DEFAULT_FILES[@]}"
fi
exec "$PY" -m pytest -m gpu -p no:cacheprovider "$@"
