"""The simulator's process pool (sim/pool.py): a run killed with cells in flight leaves no
worker computing them. Real processes: a parent starts a pool whose one worker runs a
60 s cell, the parent is SIGKILLed, and the worker must be gone within a few polls."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

from kvflow.sim.pool import PARENT_POLL_S

REPO = Path(__file__).resolve().parents[2]

PARENT = textwrap.dedent(
    """
    import os, sys, time
    from kvflow.sim.pool import process_pool

    def cell(path):
        with open(path, "w") as f:
            f.write(str(os.getpid()))
        time.sleep(60)  # a long cell, still running when its run is killed

    if __name__ == "__main__":
        pool = process_pool(1)
        pool.submit(cell, sys.argv[1])
        time.sleep(60)
    """
)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    # A zombie (exited, not yet reaped by its new parent) counts as gone.
    status = Path(f"/proc/{pid}/status")
    return not (status.exists() and "\nState:\tZ" in status.read_text())


def test_a_killed_runs_pool_worker_exits(tmp_path: Path) -> None:
    script = tmp_path / "parent.py"
    script.write_text(PARENT)
    pid_file = tmp_path / "worker.pid"
    roots = ("proto", "engine_worker", "router", "sim", "loadgen", "cli")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(str(REPO / d) for d in roots)}
    parent = subprocess.Popen([sys.executable, str(script), str(pid_file)], env=env)
    worker_pid = 0
    try:
        deadline = time.monotonic() + 30
        while not (pid_file.exists() and pid_file.read_text()):
            assert time.monotonic() < deadline, "the pool's worker never started its cell"
            assert parent.poll() is None, "the parent died before its pool ran"
            time.sleep(0.05)
        worker_pid = int(pid_file.read_text())
        assert _alive(worker_pid)
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        deadline = time.monotonic() + 10 * PARENT_POLL_S + 2
        while _alive(worker_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(worker_pid), "the killed run's pool worker went on with its cell"
    finally:
        parent.kill()
        if worker_pid and _alive(worker_pid):
            os.kill(worker_pid, signal.SIGKILL)


def test_a_comparison_on_the_pool_equals_the_same_in_one_process() -> None:
    """``--jobs 2`` runs the same ladders, through this pool, to the same figures."""
    from kvflow.engine_worker.sim.profile_file import resolve_profile
    from kvflow.loadgen.report_json import point_dict
    from kvflow.sim.cluster import ClusterSpec
    from kvflow.sim.compare import ComparisonConfig, run_comparison

    spec = ClusterSpec(resolve_profile("h100-llama3-8b"), num_workers=4)

    def figures(jobs: int) -> list[tuple[str, list[dict[str, object]]]]:
        config = ComparisonConfig(trace_path="", arms=["round-robin", "least-loaded"],
                                  workloads=["no-reuse"], quick=True, jobs=jobs)  # fmt: skip
        result = run_comparison(config, spec)
        return [(ladder.arm, [point_dict(p) for p in ladder.points])
                for ladder in result.ladders]  # fmt: skip

    assert figures(2) == figures(1)
