"""Circuit breakers against real worker processes whose Generate fails or stalls on cue
(KVFLOW_FAULT_GENERATE_FILE: while the file exists, every call fails with the gRPC status
it names, or sends nothing; removing it makes the worker well again, its Health serving
throughout):

- a worker that returns errors has its circuit opened after --breaker-min-requests of
  them, one that stalls after one; while open it gets no request (its own counters say
  so, though it is healthy again); half-open probes close the circuit once it recovers;
- a pool whose workers' circuits are all open answers 503 with Retry-After (the open
  time left) and an error naming the open circuit, at once; a model split between pools
  is drawn among the others meanwhile.
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable, Iterator
from contextlib import ExitStack, contextmanager
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.scrape import sample
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "sim"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--num-kv-blocks", "256",
            "--sim-base-step-ms", "2"]  # fmt: skip
MIN_REQUESTS = 4
OPEN_S = 4.0
FIRST_TOKEN_S = 1.5
BREAKER_ARGS = ["--breaker-error-rate", "0.5", "--breaker-window-s", "60",
                "--breaker-min-requests", str(MIN_REQUESTS), "--breaker-open-s", str(OPEN_S),
                "--breaker-max-open-s", "30", "--breaker-half-open-probes", "2",
                "--first-token-timeout-s", str(FIRST_TOKEN_S),
                "--token-stall-timeout-s", "5"]  # fmt: skip
CLOSED, HALF_OPEN, OPEN = 0.0, 1.0, 2.0


@contextmanager
def cluster(
    tmp_path: Path, num_workers: int
) -> Iterator[tuple[GatewayProcess, list[WorkerProcess], list[Path]]]:
    """Simulated workers, each with its own fault file (absent: healthy), behind a gateway
    with a quick breaker."""
    with ExitStack() as stack:
        workers, faults = [], []
        for i in range(num_workers):
            fault = tmp_path / f"fault-{i}"
            worker = launch_worker(SIM_ARGS, timeout_s=120,
                                   env={"KVFLOW_FAULT_GENERATE_FILE": str(fault)})  # fmt: skip
            stack.callback(worker.stop, timeout_s=10)
            workers.append(worker)
            faults.append(fault)
        gateway = launch_gateway(["--served-model-name", MODEL, "--seed", "0",
                                  "--workers", ",".join(w.address for w in workers),
                                  *BREAKER_ARGS])  # fmt: skip
        stack.callback(gateway.stop)
        gateway.wait_ready(num_workers=num_workers)
        yield gateway, workers, faults


def complete(gateway: GatewayProcess, i: int) -> httpx.Response:
    start = (100 * i) % 40_000  # distinct prompts, inside the vocabulary
    body = {"model": MODEL, "prompt": list(range(start, start + 40)), "max_tokens": 4}
    return httpx.post(f"{gateway.base_url}/completions", json=body,
                      headers={"x-kvflow-route": "1"}, timeout=60)  # fmt: skip


def workers_tried(response: httpx.Response) -> list[str]:
    return re.findall(r"worker=([^;,]+)", response.headers.get("x-kvflow-route", ""))


def circuit(gateway: GatewayProcess, worker: WorkerProcess) -> float:
    return sample(f"{gateway.url}/metrics", "kvflow_router_worker_circuit_state",
                  worker=worker.address)  # fmt: skip


def pool_circuit(gateway: GatewayProcess) -> float:
    return sample(f"{gateway.url}/metrics", "kvflow_router_pool_circuit_state", pool="default")


def transitions(gateway: GatewayProcess, scope: str, was: str, to: str) -> float:
    return sample(f"{gateway.url}/metrics", "kvflow_router_circuit_transitions_total",
                  scope=scope, from_state=was, to_state=to)  # fmt: skip


def finished_on(worker: WorkerProcess) -> float:
    """Requests the worker's engine ran to their end, by its own count."""
    url = f"http://127.0.0.1:{worker.metrics_port}/metrics"
    return sample(url, "kvflow_worker_requests_finished_total")


def wait_for(read: Callable[[], float], value: float, timeout_s: float) -> None:
    deadline_s = time.monotonic() + timeout_s
    while read() != value:
        assert time.monotonic() < deadline_s, f"still {read()}, not {value}"
        time.sleep(0.1)


@pytest.mark.parametrize(("fault", "num_to_open"), [("ABORTED", MIN_REQUESTS), ("stall", 1)])
def test_a_failing_worker_is_cut_off_then_probed_back(
    tmp_path: Path, fault: str, num_to_open: int
) -> None:
    with cluster(tmp_path, 2) as (gateway, (healthy, bad), (_, bad_fault)):
        bad_fault.write_text(fault)
        # Every request succeeds (the failed attempts fail over); the bad worker's circuit
        # opens after exactly num_to_open of its attempts failed.
        num_bad_attempts = 0
        for i in range(8 * MIN_REQUESTS):
            r = complete(gateway, i)
            assert r.status_code == 200, r.text
            num_bad_attempts += workers_tried(r).count(bad.address)
            if circuit(gateway, bad) == OPEN:
                break
        else:
            pytest.fail(f"the circuit never opened ({num_bad_attempts} failed attempts)")
        opened_s = time.monotonic()
        assert num_bad_attempts == num_to_open
        assert transitions(gateway, "worker", "closed", "open") == 1
        assert pool_circuit(gateway) == CLOSED  # the healthy worker still serves the pool
        # The worker is well again, but nothing goes there while its circuit is open.
        bad_fault.unlink()
        finished_before = finished_on(bad)
        num_sent = 0
        while time.monotonic() - opened_s < OPEN_S - 1.5:
            r = complete(gateway, 1000 + num_sent)
            assert r.status_code == 200, r.text
            assert workers_tried(r) == [healthy.address]
            assert f"circuit_open={bad.address}" in r.headers["x-kvflow-route"]
            num_sent += 1
        assert num_sent >= 3 and circuit(gateway, bad) == OPEN  # all sent while open
        assert finished_on(bad) == finished_before
        # Then half-open: probes go to it, and two that succeed close its circuit.
        wait_for(lambda: circuit(gateway, bad), HALF_OPEN, timeout_s=OPEN_S + 2)
        probes = []
        for i in range(12):
            r = complete(gateway, 2000 + i)
            assert r.status_code == 200, r.text
            if workers_tried(r) == [bad.address]:
                assert "circuit=half_open" in r.headers["x-kvflow-route"]
                probes.append(r)
            if circuit(gateway, bad) == CLOSED:
                break
        assert len(probes) == 2 and circuit(gateway, bad) == CLOSED
        assert finished_on(bad) == finished_before + 2
        assert transitions(gateway, "worker", "half_open", "closed") == 1


def test_a_pool_whose_workers_circuits_are_all_open_answers_503_at_once(tmp_path: Path) -> None:
    with cluster(tmp_path, 1) as (gateway, (worker,), (fault,)):
        fault.write_text("stall")
        started_s = time.monotonic()
        r = complete(gateway, 0)  # waits for the first-token deadline, then has nowhere to go
        assert r.status_code == 503 and time.monotonic() - started_s >= FIRST_TOKEN_S, r.text
        assert circuit(gateway, worker) == OPEN and pool_circuit(gateway) == OPEN
        # Healthy by its probes, yet no request waits on it: each is refused at once.
        for i in range(3):
            started_s = time.monotonic()
            r = complete(gateway, 1 + i)
            elapsed_s = time.monotonic() - started_s
            assert r.status_code == 503, r.text
            assert elapsed_s < 0.5, f"{elapsed_s:.2f} s: the request waited"
            assert 1 <= int(r.headers["retry-after"]) <= OPEN_S
            error = r.json()["error"]
            assert error["code"] == "circuit_open" and error["type"] == "server_error"
            assert "circuit breaker of pool 'default' is open" in error["message"]
            assert "stalled" in error["message"]
        # Well again: once half-open, its probes close the worker's circuit and the pool's.
        fault.unlink()
        wait_for(lambda: pool_circuit(gateway), HALF_OPEN, timeout_s=OPEN_S + 2)
        deadline_s = time.monotonic() + 10
        while pool_circuit(gateway) != CLOSED:
            assert time.monotonic() < deadline_s
            assert complete(gateway, 10).status_code == 200
        assert circuit(gateway, worker) == CLOSED


def test_a_model_split_between_pools_leaves_out_the_pool_whose_circuit_is_open(
    tmp_path: Path,
) -> None:
    with ExitStack() as stack:
        workers, faults = {}, {}
        for pool in ("a", "b"):
            faults[pool] = tmp_path / f"fault-{pool}"
            workers[pool] = launch_worker(
                ["--simulate", "--served-model-name", f"m-{pool}", "--sim-base-step-ms", "2"],
                timeout_s=120, env={"KVFLOW_FAULT_GENERATE_FILE": str(faults[pool])},
            )  # fmt: skip
            stack.callback(workers[pool].stop, timeout_s=10)
        config = {
            "pools": [{"name": p, "served_model_name": f"m-{p}", "workers": [w.address]}
                      for p, w in workers.items()],
            "models": [{"name": "m", "targets": [{"pool": "a", "weight": 50},
                                                 {"pool": "b", "weight": 50}]}],
        }  # fmt: skip
        path = tmp_path / "router.yaml"
        path.write_text(yaml.safe_dump(config))
        gateway = launch_gateway(["--config", str(path), "--seed", "0", *BREAKER_ARGS])
        stack.callback(gateway.stop)
        gateway.wait_ready(num_workers=2)

        def ask(model: str) -> httpx.Response:
            body = {"model": model, "prompt": "hello", "max_tokens": 2}
            return httpx.post(f"{gateway.base_url}/completions", json=body, timeout=60)

        faults["b"].write_text("stall")
        for _ in range(20):  # until a draw lands on pool b, whose one worker stalls
            r = ask("m")
            if r.status_code == 503:
                break
            assert r.status_code == 200 and r.json()["model"] == "m-a", r.text
        else:
            pytest.fail("no request was drawn to pool b")
        # Pool b's circuit is open: every draw goes to pool a, none is refused.
        models = [ask("m") for _ in range(8)]
        assert [(r.status_code, r.json().get("model")) for r in models] == [(200, "m-a")] * 8
        # Asked by its own name, pool b answers 503 at once, naming its circuit.
        started_s = time.monotonic()
        r = ask("m-b")
        assert r.status_code == 503 and time.monotonic() - started_s < 0.5, r.text
        assert r.json()["error"]["code"] == "circuit_open"
        assert "pool 'b'" in r.json()["error"]["message"]
