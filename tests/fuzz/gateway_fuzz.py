"""schemathesis against a real gateway process in front of simulated workers.

Used by test_gateway_schemathesis.py (a short run in CI) and by hand for the long run
whose numbers are in docs/benchmarks.md ("Fuzzing"):

    flock /tmp/kvflow-bench.lock .venv/bin/python tests/fuzz/gateway_fuzz.py \\
        --max-examples 400 --json out/fuzz/gateway.json

The gateway serves its own schema (/openapi.json, router/kvflow/router/api/openapi.py);
schemathesis generates valid and invalid requests from it (examples, coverage and fuzzing
phases) and checks every answer: no 5xx, a status the schema lists, the listed content
type and headers, a body that matches the listed schema, and no invalid body accepted.
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import subprocess
import sys
import time
import xml.etree.ElementTree as ET
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
if str(TESTS) not in sys.path:  # run as a script
    sys.path.insert(0, str(TESTS))

from testkit.gateway_process import GatewayProcess, launch_gateway  # noqa: E402
from testkit.worker_process import launch_worker  # noqa: E402

MODEL = "sim"
# A context of 256 tokens bounds an unbounded request (no max_tokens, ignore_eos) to a few
# hundred simulated steps of 1 ms: fuzzed requests stay fast on two shared cores.
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "1",
            "--num-kv-blocks", "2048", "--max-model-len", "256"]  # fmt: skip
CHECKS = (
    "not_a_server_error,status_code_conformance,content_type_conformance,"
    "response_headers_conformance,response_schema_conformance,negative_data_rejection"
)


# Bugs found by this fuzzer and not fixed yet, each with the request bodies it explains.
# Their failures are counted apart; remove an entry once it is fixed. (The two it found
# first, an unhashable message role and int32 counts past 2**31 - 1, are fixed and held by
# tests/fuzz/test_parser_properties.py.)
KNOWN_BUGS: dict[str, Callable[[object], bool]] = {}


@dataclass
class FuzzResult:
    num_requests: int
    num_5xx: int
    statuses: dict[str, int]
    failures: list[str]  # not explained by KNOWN_BUGS
    known_failures: dict[str, int]  # test cases per known bug
    num_unexplained_5xx: int
    seconds: float
    max_examples: int
    seed: int
    exit_code: int
    per_operation: dict[str, int] = field(default_factory=dict)


@contextmanager
def sim_gateway(num_workers: int = 2) -> Iterator[GatewayProcess]:
    with ExitStack() as stack:
        workers = []
        for _ in range(num_workers):
            w = launch_worker(SIM_ARGS, timeout_s=120)
            stack.callback(w.stop, timeout_s=10)
            workers.append(w)
        g = launch_gateway(["--served-model-name", MODEL, "--seed", "0",
                            "--workers", ",".join(w.address for w in workers)])  # fmt: skip
        stack.callback(g.stop)
        g.wait_ready(num_workers=num_workers)
        yield g


def _schemathesis() -> str:
    found = Path(sys.executable).with_name("st")
    return str(found) if found.exists() else (shutil.which("st") or "st")


def _known_bug(body_text: str | None) -> str | None:
    try:
        body = json.loads(body_text or "null")
    except ValueError:
        return None
    return next((name for name, explains in KNOWN_BUGS.items() if explains(body)), None)


@dataclass
class _Har:
    statuses: Counter[str]
    operations: Counter[str]
    bodies: dict[str, str]  # test case id -> request body
    num_unexplained_5xx: int


def _read_har(har_path: Path) -> _Har:
    entries = json.loads(har_path.read_text())["log"]["entries"]
    bodies: dict[str, str] = {}
    num_unexplained_5xx = 0
    for e in entries:
        request = e["request"]
        text = (request.get("postData") or {}).get("text")
        case_id = next((h["value"] for h in request["headers"]
                        if h["name"].lower() == "x-schemathesis-testcaseid"), None)  # fmt: skip
        if case_id is not None and text is not None:
            bodies[case_id] = text
        if e["response"]["status"] >= 500 and _known_bug(text) is None:
            num_unexplained_5xx += 1
    return _Har(
        statuses=Counter(str(e["response"]["status"]) for e in entries),
        operations=Counter(
            f"{e['request']['method']} /{e['request']['url'].split('/', 3)[-1].split('?')[0]}"
            for e in entries
        ),
        bodies=bodies,
        num_unexplained_5xx=num_unexplained_5xx,
    )


def run_schemathesis(
    gateway: GatewayProcess, workdir: Path, *, max_examples: int, seed: int, max_time_s: int
) -> FuzzResult:
    workdir = workdir.resolve()
    workdir = workdir.resolve()
    workdir.mkdir(parents=True, exist_ok=True)
    har, junit = workdir / "requests.har", workdir / "junit.xml"
    cmd = [
        _schemathesis(), "run", f"{gateway.url}/openapi.json",
        "--checks", CHECKS,
        "--max-examples", str(max_examples),
        "--seed", str(seed),
        "--max-time", str(max_time_s),
        # Stateful runs would mostly repeat GET /v1/models (the one link it can follow).
        "--phases", "examples,coverage,fuzzing",
        "--workers", "1",
        "--request-timeout", "30",
        "--report", "har,junit",
        "--output-sanitize", "false",
        "--report-har-path", str(har),
        "--report-junit-path", str(junit),
        "--suppress-health-check", "too_slow",
    ]  # fmt: skip
    started = time.monotonic()
    # In workdir: schemathesis keeps its state in ./.schemathesis.
    proc = subprocess.run(
        cmd, check=False, capture_output=True, text=True, cwd=workdir, timeout=max_time_s + 300
    )
    seconds = time.monotonic() - started
    (workdir / "schemathesis.log").write_text(proc.stdout + proc.stderr)
    requests = _read_har(har)
    failures: list[str] = []
    known: Counter[str] = Counter()
    for failure, case_ids in _junit_failures(junit):
        bugs = {_known_bug(requests.bodies.get(case_id)) for case_id in case_ids}
        if case_ids and None not in bugs:
            known.update(str(bug) for bug in bugs)
        else:
            failures.append(failure)
    statuses = requests.statuses
    return FuzzResult(
        num_requests=sum(statuses.values()),
        num_5xx=sum(n for s, n in statuses.items() if s.startswith("5")),
        statuses=dict(sorted(statuses.items())),
        failures=failures,
        known_failures=dict(known),
        num_unexplained_5xx=requests.num_unexplained_5xx,
        seconds=round(seconds, 1),
        max_examples=max_examples,
        seed=seed,
        exit_code=proc.returncode,
        per_operation=dict(sorted(requests.operations.items())),
    )


def _junit_failures(path: Path) -> list[tuple[str, list[str]]]:
    """(what failed, the test case ids it names) per failure or error of the run."""
    if not path.exists():
        return [("schemathesis wrote no JUnit report", [])]
    out = []
    for case in ET.parse(path).getroot().iter("testcase"):
        for problem in [*case.iter("failure"), *case.iter("error")]:
            text = problem.text or ""
            summary = f"{case.get('name')}: {problem.get('message')}\n{text[:3000]}"
            out.append((summary, re.findall(r"Test Case ID: (\w+)", text)))
    return out


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--max-examples", type=int, default=400, help="per operation and phase")
    parser.add_argument("--seed", type=int, default=11)
    parser.add_argument("--max-time-s", type=int, default=900)
    parser.add_argument("--workdir", type=Path, default=Path("out/fuzz/gateway"))
    parser.add_argument("--json", type=Path, help="write the result here")
    args = parser.parse_args()
    with sim_gateway() as gateway:
        result = run_schemathesis(gateway, args.workdir, max_examples=args.max_examples,
                                  seed=args.seed, max_time_s=args.max_time_s)  # fmt: skip
    text = json.dumps(asdict(result), indent=2)
    print(text)
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(text + "\n")
    return 0 if not result.failures and not result.num_unexplained_5xx else 1


if __name__ == "__main__":
    sys.exit(main())
