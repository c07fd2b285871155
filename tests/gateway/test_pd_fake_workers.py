"""Disaggregated serving through a real gateway process against scripted workers: the
handoff on the wire, the decision, and each router-side fault (a prefill that fails or
hangs, a decode worker that dies after reserving or never reserves, a client that leaves
during the transfer). The workers' own counters say whether both sides were freed.

Real worker processes shipping real KV are tested on top of this code path elsewhere.
"""

from __future__ import annotations

import json
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import openai
import pytest
import yaml
from testkit.fake_worker import BYTES_PER_TOKEN, FakeKvFabric, FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway

from kvflow.proto import worker_pb2 as pb
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENIZER = load_text_model(None).tokenizer
TEXT = " The quick brown fox jumps"
TOKENS = TOKENIZER.encode(TEXT, add_special_tokens=False)
# Long enough that a call cancelled by the router and one ended by its deadline differ.
TRANSFER_TIMEOUT_S = 3.0
# 200 tokens: 12 whole blocks end before the last token, 192 tokens to ship (>= 64).
LONG = list(range(1000, 1200))
SHORT = list(range(1000, 1040))  # 2 blocks, 32 tokens: below the 64-token threshold


@dataclass
class Pool:
    prefill: FakeWorker
    decode: FakeWorker  # the first choice: its twin looks busy
    decode2: FakeWorker
    addresses: dict[str, str]
    gateway: GatewayProcess

    def reset(self) -> None:
        for w in (self.prefill, self.decode, self.decode2):
            w.mode, w.reserve_mode, w.prefill_script = "ok", "ok", []
            w.reserve_delay_s = w.die_delay_s = 0.0
            w.num_cached_prompt_tokens = 0
            w.is_serving = True
        self.gateway.wait_ready(num_workers=3)


@pytest.fixture(scope="module")
def pool(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Pool]:
    fabric = FakeKvFabric()
    prefill = FakeWorker(tokens=TOKENS, role=pb.ROLE_PREFILL, fabric=fabric)
    decode = FakeWorker(tokens=TOKENS, role=pb.ROLE_DECODE, fabric=fabric)
    decode2 = FakeWorker(tokens=TOKENS, role=pb.ROLE_DECODE, fabric=fabric, num_running=5)
    config = tmp_path_factory.mktemp("pd") / "router.yaml"
    config.write_text(yaml.safe_dump({"disaggregation": {
        "min_remote_prefill_tokens": 64, "transfer_timeout_s": TRANSFER_TIMEOUT_S}}))  # fmt: skip
    with (
        running_fake_worker(prefill) as p,
        running_fake_worker(decode) as d,
        running_fake_worker(decode2) as d2,
        running_gateway(["--workers", f"{p},{d},{d2}", "--config", str(config)]) as g,
    ):
        g.wait_ready(num_workers=3)
        yield Pool(prefill, decode, decode2, {"p": p, "d": d, "d2": d2}, g)


@pytest.fixture
def pd(pool: Pool) -> Pool:
    pool.reset()
    return pool


def complete(pool: Pool, prompt: list[int], request_id: str) -> httpx.Response:
    body = {"model": "fake", "prompt": prompt, "max_tokens": 8}
    headers = {"x-request-id": request_id, "x-kvflow-route": "1"}
    r = httpx.post(f"{pool.gateway.base_url}/completions", json=body, headers=headers, timeout=30)
    assert r.status_code == 200, r.text
    assert r.json()["choices"][0]["text"] == TEXT
    return r


def server_id(worker: FakeWorker) -> str:
    """The id the gateway gave the worker's last request, without its choice and attempt
    suffix: its own, never the caller's x-request-id."""
    return worker.requests[-1].request_id.rsplit("-c", 1)[0]


def metric(pool: Pool, name: str, labels: str = "") -> float:
    wanted = f"{name}{{{labels}}}" if labels else name
    for line in httpx.get(f"{pool.gateway.url}/metrics").text.splitlines():
        if line.startswith(wanted + " "):
            return float(line.split()[1])
    return 0.0


def everything_freed(*workers: FakeWorker) -> None:
    deadline = time.monotonic() + 5
    while any(w.num_reserved or w.num_prefilling for w in workers):
        assert time.monotonic() < deadline, "a fake worker still holds blocks"
        time.sleep(0.02)


def test_a_long_prompt_is_prefilled_remotely_and_streamed_by_decode(pd: Pool) -> None:
    sent_before = metric(pd, "kvflow_router_pd_transfers_total", 'outcome="sent"')
    decided_before = metric(pd, "kvflow_router_pd_decisions_total",
                            'decision="disaggregated",reason="many_missing_tokens"')  # fmt: skip
    tokens_before = metric(pd, "kvflow_router_pd_transfer_tokens_total")
    bytes_before = metric(pd, "kvflow_router_pd_transfer_bytes_total")
    seconds_before = metric(pd, "kvflow_router_pd_transfer_seconds_count")
    r = complete(pd, LONG, "pd-long")
    route = r.headers["x-kvflow-route"]
    assert route.startswith(f"choice=0; prefill={pd.addresses['p']} decode={pd.addresses['d']}")
    assert "reason=many_missing_tokens; missing_tokens=192" in route
    generate = pd.decode.requests[-1]
    rid = server_id(pd.decode)
    assert generate.request_id == f"{rid}-c0-a0" and "pd-long" not in rid
    assert generate.remote_prefill.version == pb.KV_HANDOFF_VERSION_1
    assert generate.remote_prefill.timeout_s == TRANSFER_TIMEOUT_S
    prefill = pd.prefill.prefill_requests[-1]
    assert prefill.request_id == f"{rid}-c0-a0"  # one id on both workers
    assert prefill.destination == pd.decode.reservations[-1]  # handed on verbatim
    assert list(prefill.prompt_token_ids) == LONG
    assert (prefill.cache_salt, prefill.priority) == (generate.cache_salt, generate.priority)
    assert pd.decode.transfer_outcomes[-1] == "landed"
    assert metric(pd, "kvflow_router_pd_transfers_total", 'outcome="sent"') == sent_before + 1
    decided = metric(pd, "kvflow_router_pd_decisions_total",
                     'decision="disaggregated",reason="many_missing_tokens"')  # fmt: skip
    assert decided == decided_before + 1
    # Tokens shipped are the reservation's [16 * 0, 16 * 12), bytes as the prefill reports.
    assert metric(pd, "kvflow_router_pd_transfer_tokens_total") == tokens_before + 192
    assert metric(pd, "kvflow_router_pd_transfer_bytes_total") == (
        bytes_before + 192 * BYTES_PER_TOKEN
    )
    assert metric(pd, "kvflow_router_pd_transfer_seconds_count") == seconds_before + 1
    # Streaming: the reservation is no output; the text is the decode worker's.
    client = openai.OpenAI(base_url=pd.gateway.base_url, api_key="x", max_retries=0, timeout=30)
    chunks = list(client.completions.create(model="fake", prompt=LONG, stream=True))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == TEXT
    assert len(pd.prefill.prefill_requests) == 2
    everything_freed(pd.prefill, pd.decode)


def test_decode_prefills_itself_when_a_handoff_does_not_pay(pd: Pool) -> None:
    # Too short to ship: a plain Generate, no Prefill.
    num_prefills = len(pd.prefill.prefill_requests)
    r = complete(pd, SHORT, "pd-short")
    assert (
        f"worker={pd.addresses['d']}; plan=colocated; reason=few_missing_tokens"
        in (r.headers["x-kvflow-route"])
    )
    assert not pd.decode.requests[-1].HasField("remote_prefill")
    # The router thought decode lacked the prompt, but decode holds it all: nothing to send.
    nothing_before = metric(pd, "kvflow_router_pd_transfers_total", 'outcome="nothing_to_send"')
    pd.decode.num_cached_prompt_tokens = len(LONG)
    complete(pd, LONG, "pd-cached")
    assert pd.decode.requests[-1].HasField("remote_prefill")
    assert len(pd.prefill.prefill_requests) == num_prefills
    assert metric(pd, "kvflow_router_pd_transfers_total", 'outcome="nothing_to_send"') == (
        nothing_before + 1
    )
    # A decode worker that prefills itself after all (no reservation) still serves.
    not_reserved_before = metric(pd, "kvflow_router_pd_transfers_total", 'outcome="not_reserved"')
    pd.decode.reserve_mode = "ignore"
    complete(pd, LONG, "pd-ignored")
    assert len(pd.prefill.prefill_requests) == num_prefills
    assert metric(pd, "kvflow_router_pd_transfers_total", 'outcome="not_reserved"') == (
        not_reserved_before + 1
    )
    # A pool whose prefill worker is draining serves colocated on decode.
    pd.decode.reserve_mode, pd.prefill.is_serving = "ok", False
    deadline = time.monotonic() + 10
    while httpx.get(f"{pd.gateway.url}/ready").json()["workers_healthy"] != 2:
        assert time.monotonic() < deadline, "the draining prefill worker stayed healthy"
        time.sleep(0.05)
    r = complete(pd, LONG, "pd-no-prefill")
    assert "plan=colocated; reason=no_prefill_worker" in r.headers["x-kvflow-route"]
    assert not pd.decode.requests[-1].HasField("remote_prefill")
    everything_freed(pd.prefill, pd.decode)


@pytest.mark.parametrize(
    ("mode", "kind"),
    [
        ("unavailable", "prefill_unavailable"),
        ("invalid", "prefill_rejected"),
        ("aborted", "prefill_failed"),
        ("hang", "prefill_timeout"),
    ],
)
def test_a_failed_prefill_falls_back_to_a_local_prefill(pd: Pool, mode: str, kind: str) -> None:
    failures_before = metric(pd, "kvflow_router_pd_failures_total", f'kind="{kind}"')
    fallbacks_before = metric(pd, "kvflow_router_pd_transfers_total", 'outcome="fallback"')
    pd.prefill.prefill_script = [mode]
    started_s = time.monotonic()
    complete(pd, LONG, f"pd-{mode}")
    elapsed_s = time.monotonic() - started_s
    rid = server_id(pd.decode)
    if mode == "hang":
        # Both waits end together: the decode worker's own (from reserving) and the Prefill
        # call's deadline (from a moment later); either way decode prefilled locally.
        assert TRANSFER_TIMEOUT_S <= elapsed_s < TRANSFER_TIMEOUT_S + 3
        assert pd.decode.transfer_outcomes[-1] in ("cancelled", "deadline")
        assert pd.prefill.cancelled[-1] == f"{rid}-c0-a0"
    else:
        # The decode worker was told at once to prefill itself, not left to its deadline.
        assert pd.decode.cancel_transfer_requests[-1] == f"{rid}-c0-a0"
        assert pd.decode.transfer_outcomes[-1] == "cancelled"
        assert elapsed_s < TRANSFER_TIMEOUT_S
    assert metric(pd, "kvflow_router_pd_failures_total", f'kind="{kind}"') == failures_before + 1
    assert metric(pd, "kvflow_router_pd_transfers_total", 'outcome="fallback"') == (
        fallbacks_before + 1
    )
    everything_freed(pd.prefill, pd.decode)


def test_decode_dying_after_reserving_frees_prefill_and_retries(pd: Pool) -> None:
    decode_failed_before = metric(pd, "kvflow_router_pd_failures_total", 'kind="decode_failed"')
    pd.decode.reserve_mode, pd.decode.die_delay_s = "die", 0.3
    pd.prefill.prefill_script = ["hang"]  # still prefilling when decode dies
    r = complete(pd, LONG, "pd-die")
    rid = server_id(pd.decode)
    route = r.headers["x-kvflow-route"]
    assert route.index(f"decode={pd.addresses['d']}") < route.index(f"decode={pd.addresses['d2']}")
    # Its Prefill call was cancelled when decode died (0.3 s in), not left to its deadline.
    assert pd.prefill.cancelled[-1] == f"{rid}-c0-a0"
    assert pd.prefill.prefill_held_s[f"{rid}-c0-a0"] < TRANSFER_TIMEOUT_S - 1
    assert pd.decode2.requests[-1].request_id == f"{rid}-c0-a1"  # a new plan, without it
    assert [p.request_id for p in pd.prefill.prefill_requests[-2:]] == [
        f"{rid}-c0-a0", f"{rid}-c0-a1",
    ]  # fmt: skip
    assert metric(pd, "kvflow_router_pd_failures_total", 'kind="decode_failed"') == (
        decode_failed_before + 1
    )
    everything_freed(pd.prefill, pd.decode, pd.decode2)
    # No decode worker left: a clear 503.
    pd.reset()
    pd.decode.reserve_mode = pd.decode2.reserve_mode = "die"
    body = {"model": "fake", "prompt": LONG, "max_tokens": 8}
    r = httpx.post(f"{pd.gateway.base_url}/completions", json=body, timeout=30)
    assert r.status_code == 503, r.text
    assert "died after reserving" in r.json()["error"]["message"]
    everything_freed(pd.prefill, pd.decode, pd.decode2)


def test_a_decode_worker_that_never_reserves_is_given_up_in_time(pd: Pool) -> None:
    timeouts_before = metric(pd, "kvflow_router_pd_failures_total", 'kind="reservation_timeout"')
    pd.decode.reserve_delay_s = 30
    started_s = time.monotonic()
    r = complete(pd, LONG, "pd-slow")
    rid = server_id(pd.decode)
    assert time.monotonic() - started_s < TRANSFER_TIMEOUT_S + 3
    assert f"decode={pd.addresses['d2']}" in r.headers["x-kvflow-route"].split(", ")[-1]
    assert pd.decode.cancelled[-1] == f"{rid}-c0-a0"
    assert pd.decode2.requests[-1].request_id == f"{rid}-c0-a1"
    assert pd.decode2.transfer_outcomes[-1] == "landed"  # the new plan disaggregated too
    assert metric(pd, "kvflow_router_pd_failures_total", 'kind="reservation_timeout"') == (
        timeouts_before + 1
    )
    everything_freed(pd.prefill, pd.decode, pd.decode2)


def post_then_leave(pool: Pool, body: dict[str, object], request_id: str) -> socket.socket:
    """Send a completion request on a raw connection the caller closes when it likes."""
    payload = json.dumps(body).encode()
    conn = socket.create_connection(("127.0.0.1", pool.gateway.port), timeout=10)
    conn.sendall(
        b"POST /v1/completions HTTP/1.1\r\nhost: test\r\ncontent-type: application/json\r\n"
        + f"x-request-id: {request_id}\r\ncontent-length: {len(payload)}\r\n\r\n".encode()
        + payload
    )
    return conn


@pytest.mark.parametrize("stream", [True, False])
def test_a_client_leaving_during_the_transfer_cancels_both_calls(pd: Pool, stream: bool) -> None:
    pd.prefill.prefill_script = ["hang"]
    request_id = f"pd-gone-{str(stream).lower()}"
    body = {"model": "fake", "prompt": LONG, "max_tokens": 8, "stream": stream}
    with post_then_leave(pd, body, request_id):
        deadline = time.monotonic() + 10
        while not pd.prefill.num_prefilling:
            assert time.monotonic() < deadline, "the prefill never started"
            time.sleep(0.01)
    # The connection closed mid-transfer, well before the transfer timeout.
    everything_freed(pd.prefill, pd.decode)
    sent = server_id(pd.decode) + "-c0-a0"
    assert request_id not in sent
    assert pd.prefill.cancelled[-1] == sent
    assert pd.prefill.prefill_held_s[sent] < TRANSFER_TIMEOUT_S - 1
    assert pd.decode.cancelled[-1] == sent
    # Cancelled, not a prefill failure handed back to the decode worker.
    assert sent not in pd.decode.cancel_transfer_requests
