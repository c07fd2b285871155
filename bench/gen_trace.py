"""Write a generated trace family as a Mooncake-format JSONL file (deterministic by seed).

The families (sim/kvflow/sim/trace_families.py) are what `kvflow sim compare` runs by
name (`--workloads conv-7k,...`); this writes one to a file, to replay it elsewhere
(`kvflow sim compare --workloads mooncake --trace FILE`, `kvflow bench --trace FILE`).

    python bench/gen_trace.py conv-7k /tmp/conv-7k.jsonl [--requests 1000] [--seed 0]
"""

from __future__ import annotations

import argparse
import sys

from kvflow.sim.trace_families import FAMILIES, family, write_trace


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("family", choices=sorted(FAMILIES))
    p.add_argument("path")
    p.add_argument("--requests", type=int, help="default: the family's 1,000")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    records = family(args.family, num_requests=args.requests, seed=args.seed)
    write_trace(records, args.path)
    duration_s = records[-1].timestamp_ms / 1e3
    mean_prompt = sum(r.input_length for r in records) / len(records)
    print(f"{args.path}: {len(records)} requests over {duration_s:.0f} s, "
          f"mean prompt {mean_prompt:.0f} tokens", file=sys.stderr)  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
