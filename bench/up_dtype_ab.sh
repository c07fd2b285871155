#!/usr/bin/env bash
# `kvflow up` serving a bfloat16 checkpoint with the default `--dtype auto` against
# `--dtype float32`, end to end through the gateway: separate runs, alternating, ROUNDS of
# each, a closed-loop ladder of users from `kvflow bench` on each. The checkpoint is
# SmolLM2-135M's shape (30 layers, hidden 576, 9/3 heads, vocab 49,152, tied embeddings)
# with random weights and SmolLM2's tokenizer, its config.json saying bfloat16 as the
# published SmolLM2's does. Prints each run's table; writes the JSON and logs to OUT_DIR.
#
#   bash bench/up_dtype_ab.sh OUT_DIR [ROUNDS] [USERS]      # default 2 rounds, users 1,16
set -euo pipefail
out=${1:?usage: bench/up_dtype_ab.sh OUT_DIR [ROUNDS] [USERS]}
rounds=${2:-2}
users=${3:-1,16}
mkdir -p "$out"
model="$out/smollm2-shape-bf16"
PYTHONPATH=tests python - "$model" <<'PY'
import json, sys
from pathlib import Path
from testkit.tiny_model import write_tiny_llama
from testkit.tokenizer_files import write_smollm2_tokenizer
folder = write_tiny_llama(Path(sys.argv[1]), seed=0, vocab_size=49152, hidden_size=576,
                          intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9,
                          num_key_value_heads=3, tie_word_embeddings=True)
write_smollm2_tokenizer(folder)
config = json.loads((folder / "config.json").read_text())
(folder / "config.json").write_text(json.dumps({**config, "torch_dtype": "bfloat16"}))
PY
port=18731
for round in $(seq 1 "$rounds"); do
  for dtype in auto float32; do
    log="$out/up-$dtype-$round.log"
    python -m kvflow.cli.main up --port "$port" --model "$model" --served-model-name m \
      --dtype "$dtype" > "$log" 2>&1 &
    up=$!
    for _ in $(seq 1 600); do grep -q "Press Ctrl-C to stop." "$log" && break; sleep 1; done
    grep -o "on cpu ([a-z0-9]*; [^)]*)" "$log" | head -1 || true
    python -m kvflow.cli.main bench --url "http://127.0.0.1:$port" --workload no-reuse \
      --prompt-words 256 --output-tokens 64 --users "$users" --duration-s 40 --warmup-s 5 \
      --json "$out/bench-$dtype-$round.json" --quiet | sed "s/^/[$dtype $round] /"
    kill -INT "$up"; wait "$up" || true
  done
done
