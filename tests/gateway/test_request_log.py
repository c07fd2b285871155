"""One log line per request, through a real gateway: what an operator needs to find and
account for a request (id, tenant, model, tokens, finish reason, timings), and never the
text of the prompt or the answer."""

from __future__ import annotations

import re
import time
from pathlib import Path

import openai
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway

from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENIZER = load_text_model(None).tokenizer
ANSWER = " zebra umbrella quartz"
PROMPT = "Remember the passphrase: marmalade telescope."


def request_lines(g: GatewayProcess, request_id: str, timeout_s: float = 10.0) -> list[str]:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        found = [line for line in g.log.splitlines() if f"request_id={request_id} " in line]
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"no log line for {request_id}:\n{g.log}")


def fields(line: str) -> dict[str, str]:
    return dict(re.findall(r'(\w+)=("[^"]*"|\S+)', line.split("kvflow.router.requests: ", 1)[1]))


def test_each_request_logs_one_line_without_its_text(tmp_path: Path) -> None:
    config = tmp_path / "router.yaml"
    config.write_text(yaml.safe_dump({"tenants": [
        {"name": "alice", "api_key_sha256": hash_api_key("sk-alice")}]}))  # fmt: skip
    worker = FakeWorker(tokens=TOKENIZER.encode(ANSWER, add_special_tokens=False))
    with (
        running_fake_worker(worker) as address,
        running_gateway(["--workers", address, "--config", str(config)]) as g,
    ):
        g.wait_ready()
        client = openai.OpenAI(base_url=g.base_url, api_key="sk-alice", max_retries=0)
        raw = client.chat.completions.with_raw_response.create(
            model="fake", messages=[{"role": "user", "content": PROMPT}], n=2
        )
        response = raw.parse()
        assert response.choices[0].message.content == ANSWER
        request_id = raw.headers["x-request-id"]
        (line,) = request_lines(g, request_id)
        got = fields(line)
        assert got["tenant"] == "alice" and got["model"] == "fake"
        assert int(got["prompt_tokens"]) == response.usage.prompt_tokens
        assert int(got["completion_tokens"]) == response.usage.completion_tokens
        # One per choice, in order, as the client was told.
        assert got["finish_reason"] == ",".join(c.finish_reason for c in response.choices)
        assert float(got["ttft_ms"]) <= float(got["e2e_ms"])
        assert got["attempts"] == "2"  # one per choice, no failover
        # A streamed request the client leaves after its first chunk: logged all the same,
        # its one choice never finished.
        worker.token_delay_s = 0.5
        headers = {"x-request-id": "left-early"}
        stream = client.completions.create(model="fake", prompt="x", stream=True,
                                           extra_headers=headers)  # fmt: skip
        next(iter(stream))
        stream.response.close()
        (left,) = request_lines(g, "left-early")
        assert fields(left)["finish_reason"] == "none"
        log = g.log
    for text in ("marmalade", "telescope", "zebra", "umbrella", "quartz"):
        assert text not in log, f"{text!r} reached the gateway's log"
