"""The whole disaggregated path with the built-in SmolLM2: the openai client asks a real
gateway; the gateway sends a long prompt's prefill to a prefill worker, which ships its KV
over gloo or TCP to a decode worker, which streams the answer. The text equals what a colocated
gateway answers, and a short prompt stays with the decode worker (it would not pay)."""

from __future__ import annotations

from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smollm2"
LONG = (
    "Here are the notes of a long meeting about a bakery. "
    + " ".join(f"Item {i}: the oven at station {i % 7} needs {i * 3} minutes." for i in range(40))
    + " Summarise the notes in one sentence."
)
SHORT = "What is the capital of France?"


COMMON = ["--served-model-name", MODEL, "--kv-cache-gib", "0.25"]


def start_workers(roles: list[str], transport: str) -> dict[str, WorkerProcess]:
    """Workers of these roles, started in parallel (each loads the model)."""
    args = [*COMMON, "--kv-transport", transport]
    with ThreadPoolExecutor(len(roles)) as pool:
        futures = {r: pool.submit(launch_worker, [*args, "--role", r], timeout_s=300)
                   for r in roles}  # fmt: skip
    started = {r: f.result() for r, f in futures.items() if f.exception() is None}
    if len(started) < len(roles):
        for w in started.values():
            w.stop(timeout_s=10)
        raise RuntimeError({r: f.exception() for r, f in futures.items()})
    return started


def gateway_for(addresses: list[str]) -> GatewayProcess:
    g = launch_gateway(["--served-model-name", MODEL, "--workers", ",".join(addresses)])
    g.wait_ready(num_workers=len(addresses))
    return g


@pytest.fixture(scope="module")
def colocated() -> Iterator[GatewayProcess]:
    workers = start_workers(["both"], "tcp")
    gateway = gateway_for([workers["both"].address])
    try:
        yield gateway
    finally:
        gateway.stop()
        workers["both"].stop(timeout_s=10)


@pytest.fixture(scope="module", params=["gloo", "tcp"])
def workers(request: pytest.FixtureRequest) -> Iterator[dict[str, WorkerProcess]]:
    started = start_workers(["prefill", "decode"], request.param)
    try:
        yield started
    finally:
        for w in started.values():
            w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def disaggregated(workers: dict[str, WorkerProcess]) -> Iterator[GatewayProcess]:
    gateway = gateway_for([workers["prefill"].address, workers["decode"].address])
    try:
        yield gateway
    finally:
        gateway.stop()


def ask(gateway: GatewayProcess, content: str) -> tuple[str, str, openai.types.CompletionUsage]:
    client = openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=300)
    raw = client.chat.completions.with_raw_response.create(
        model=MODEL,
        messages=[{"role": "user", "content": content}],
        temperature=0,
        max_tokens=24,
        extra_headers={"x-kvflow-route": "1"},
    )
    completion = raw.parse()
    assert completion.usage is not None
    return (
        completion.choices[0].message.content or "",
        raw.headers["x-kvflow-route"],
        completion.usage,
    )


def test_a_long_prompt_is_prefilled_remotely_and_answers_the_same(
    colocated: GatewayProcess, disaggregated: GatewayProcess, workers: dict[str, WorkerProcess]
) -> None:
    want, _, usage = ask(colocated, LONG)
    assert usage.prompt_tokens > 400  # well above the default min_remote_prefill_tokens
    got, route, _ = ask(disaggregated, LONG)
    assert f"prefill={workers['prefill'].address}" in route
    assert f"decode={workers['decode'].address}" in route
    assert got == want and got


def test_a_short_prompt_stays_on_the_decode_worker(
    colocated: GatewayProcess, disaggregated: GatewayProcess, workers: dict[str, WorkerProcess]
) -> None:
    want, _, _ = ask(colocated, SHORT)
    got, route, _ = ask(disaggregated, SHORT)
    assert "prefill=" not in route and workers["decode"].address in route
    assert got == want and "Paris" in got
