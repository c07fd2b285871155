"""What a `kvflow worker` process holds, resident, with each weight format, side by side.

Starts a worker on the built-in model per arm (`--quantization auto`, the default: 4-bit
planes; `none`: widened to float32), waits for it to serve, and reads its resident set
(`VmRSS`) and its start-up memory line (weights by dtype, the KV cache). The KV cache is
allocated by `torch.zeros` and its pages are backed as it is written, so a fresh worker's
resident set is mostly its weights, torch and the process itself.

    python bench/worker_memory.py [--kv-cache-gib 1] [--json PATH]
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT / "tests"))

from testkit.worker_process import launch_worker  # noqa: E402

ARMS = {"kvflow": "auto", "kvflow-widened": "none"}


def resident_bytes(pid: int) -> int:
    status = Path(f"/proc/{pid}/status").read_text()
    match = re.search(r"^VmRSS:\s+(\d+) kB", status, re.MULTILINE)
    assert match
    return int(match.group(1)) * 1024


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-cache-gib", type=float, default=1.0)
    p.add_argument("--json", type=Path)
    args = p.parse_args()
    results = {}
    for arm, quantization in ARMS.items():
        worker = launch_worker(
            ["--quantization", quantization, "--kv-cache-gib", str(args.kv_cache_gib)],
            timeout_s=300,
        )
        try:
            time.sleep(2)  # let start-up settle
            line = next((x.strip() for x in worker.output if "memory: weights" in x), "")
            results[arm] = {
                "quantization": quantization,
                "resident_bytes": resident_bytes(worker.proc.pid),
                "memory_line": line.split("memory: ", 1)[-1],
            }
        finally:
            worker.stop(timeout_s=10)
        r = results[arm]
        print(f"{arm:<15} resident {r['resident_bytes'] / 2**20:7.1f} MiB   {r['memory_line']}")
    ratio = results["kvflow-widened"]["resident_bytes"] / results["kvflow"]["resident_bytes"]
    print(f"widened / quantized resident: {ratio:.2f}x")
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps({"kv_cache_gib": args.kv_cache_gib, "arms": results,
                                         "resident_ratio": ratio}, indent=2) + "\n")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
