"""`kvflow sim`: virtual-time clusters on this machine (docs/simulator.md).

- ``kvflow sim run``: `kvflow bench` against a simulated cluster in virtual time: the same
  workload and load options (``--url`` aside), one ladder per routing arm.
- ``kvflow sim compare``: the routing comparison of docs/benchmarks.md.
- ``kvflow sim overload``: a pool at twice its capacity, degradation off and on.
- ``kvflow sim calibrate``: a fitted profile against the real engine on held-out traffic.
- ``kvflow sim cascade``: a small-then-large model cascade on a mixed workload (sim/cascade.py).
- ``kvflow sim batch-day``: a Batch API batch at a day's peak, with and without, over seeds.

Exit status: 0 done, 1 the run produced nothing usable, 2 bad options or inputs.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Sequence
from typing import TextIO

SUBCOMMANDS = {
    "run": "kvflow.sim.run_cli",
    "compare": "kvflow.sim.compare_cli",
    "overload": "kvflow.sim.overload_cli",
    "calibrate": "kvflow.cli.sim_calibrate",
    "cascade": "kvflow.sim.cascade_cli",
    "batch-day": "kvflow.sim.batch_day_cli",
}
USAGE = (
    "usage: kvflow sim {run,compare,overload,cascade,batch-day,calibrate} [options]"
    "   (each takes --help)"
)


def main(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    argv = list(argv)
    if not argv or argv[0] in ("-h", "--help"):
        print(USAGE, file=out if argv else err)
        return 0 if argv else 2
    module = SUBCOMMANDS.get(argv[0])
    if module is None:
        print(f"kvflow sim: unknown subcommand {argv[0]!r}\n{USAGE}", file=err)
        return 2
    code: int = importlib.import_module(module).main(argv[1:], out, err)
    return code


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
