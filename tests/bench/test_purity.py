"""The load generator's workloads, arrivals, metrics and reports stay pure, so the virtual-time
simulator can reuse them: no network, no clock, no event loop (import-linter holds the
components' cores; this holds the load generator's, by reading each module's imports)."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

import kvflow.loadgen

PURE = ["text", "workload", "shared_prefix", "multi_turn", "no_reuse", "trace", "trace_replay",
        "arrivals", "records", "sse", "payloads", "metrics", "summary", "report_table",
        "report_json"]  # fmt: skip
SHELLS = ["client", "runner", "ladder", "plots", "progress", "options"]
FORBIDDEN = {"httpx", "asyncio", "time", "matplotlib", "socket"} | {
    f"kvflow.loadgen.{shell}" for shell in SHELLS
}
PACKAGE = Path(kvflow.loadgen.__file__).parent


def imported(module: str) -> set[str]:
    tree = ast.parse((PACKAGE / f"{module}.py").read_text())
    names: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            names.add(node.module)
    return names


@pytest.mark.parametrize("module", PURE)
def test_pure_module_imports_no_io(module: str) -> None:
    bad = {n for n in imported(module) if n in FORBIDDEN or n.split(".")[0] in FORBIDDEN}
    assert not bad, f"kvflow.loadgen.{module} imports {sorted(bad)}"


def test_every_module_is_classified() -> None:
    assert {p.stem for p in PACKAGE.glob("*.py")} == {"__init__", *PURE, *SHELLS}
