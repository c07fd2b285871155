"""A decode worker that evicted blocks the router thought it held, with real processes.

The router decides from its index (the workers' KV events); the decode worker reserves from
its own cache. When the two disagree (events lost or late), the worker's view must win: it
reserves every block it lacks, the prefill worker sends all of them, and the answer is the
same as colocated serving. The decode worker here runs with KVFLOW_FAULT_HIDE_KV_REMOVALS,
so it publishes its evictions without block hashes and the router's index stays stale.
"""

from __future__ import annotations

import re
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml
from testkit import pd_client as pc
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration]

BLOCK = 16
PREFIX = [(i * 37) % 900 + 20 for i in range(10 * BLOCK)]  # 10 blocks
PROMPT = PREFIX + [(i * 11) % 700 + 30 for i in range(5 * BLOCK + 3)]  # 15 blocks + 3
FILLERS = [[(i * 7 + k * 101) % 800 + 40 for i in range(20 * BLOCK)] for k in range(2)]
DECODE_BLOCKS = 24  # one filler evicts everything else; PROMPT alone needs 16
MIN_REMOTE_TOKENS = 64


def worker(
    model: Path, role: str, num_blocks: int, env: dict[str, str] | None = None
) -> WorkerProcess:
    args = ["--model", str(model), "--role", role, "--kv-transport", "tcp"]
    return launch_worker([*args, "--num-kv-blocks", str(num_blocks)], timeout_s=120, env=env)


def complete(gateway: GatewayProcess, prompt: list[int]) -> tuple[str, str]:
    body = {
        "model": "tiny",
        "prompt": prompt,
        "max_tokens": 12,
        "temperature": 0,
        "ignore_eos": True,
    }
    r = httpx.post(f"{gateway.base_url}/completions", json=body,
                   headers={"x-kvflow-route": "1"}, timeout=60)  # fmt: skip
    assert r.status_code == 200, r.text
    return r.json()["choices"][0]["text"], r.headers["x-kvflow-route"]


def transfer_tokens(gateway: GatewayProcess) -> float:
    text = httpx.get(f"{gateway.url}/metrics", timeout=10).text
    match = re.search(r"^kvflow_router_pd_transfer_tokens_total (\S+)$", text, re.M)
    return float(match.group(1)) if match else 0.0


@pytest.fixture(scope="module")
def pools(
    tiny_model: Path, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[tuple[GatewayProcess, GatewayProcess, WorkerProcess]]:
    config = tmp_path_factory.mktemp("stale") / "router.yaml"
    config.write_text(
        yaml.safe_dump({"disaggregation": {"min_remote_prefill_tokens": MIN_REMOTE_TOKENS}})
    )
    with ExitStack() as stack:
        both = worker(tiny_model, "both", 256)
        stack.callback(both.stop, timeout_s=10)
        prefill = worker(tiny_model, "prefill", 256)
        stack.callback(prefill.stop, timeout_s=10)
        decode = worker(tiny_model, "decode", DECODE_BLOCKS, {"KVFLOW_FAULT_HIDE_KV_REMOVALS": "1"})
        stack.callback(decode.stop, timeout_s=10)
        gateways = []
        for addresses in ([both.address], [prefill.address, decode.address]):
            g = launch_gateway(["--served-model-name", "tiny", "--config", str(config),
                                "--workers", ",".join(addresses)])  # fmt: skip
            stack.callback(g.stop)
            g.wait_ready(num_workers=len(addresses))
            gateways.append(g)
        yield gateways[0], gateways[1], decode


def test_decode_reserves_what_it_lacks_not_what_the_router_believes(
    pools: tuple[GatewayProcess, GatewayProcess, WorkerProcess],
) -> None:
    colocated, pd, decode = pools
    # 1. The prefix is shipped to the decode worker, which caches it; the router learns so.
    _, route = complete(pd, PREFIX + [5])
    assert "plan=disaggregated" in route and "missing_tokens=160" in route, route
    # 2. Other prompts, served by the decode worker alone, evict the prefix there; the
    # router hears no eviction.
    for filler in FILLERS:
        pc.colocated(pc.stub(decode.address), f"filler-{filler[0]}", filler, 1)
    # 3. The router believes the decode worker holds 10 blocks of PROMPT and lacks 80
    # tokens; the worker lacks all 240 tokens before the last block and reserves them all.
    before = transfer_tokens(pd)
    got, route = complete(pd, PROMPT)
    assert "plan=disaggregated" in route and "missing_tokens=80;" in route, route
    assert transfer_tokens(pd) - before == 15 * BLOCK
    want, _ = complete(colocated, PROMPT)
    assert got == want
    # Nothing is left reserved or running on the decode worker.
    pc.wait_idle(pc.stub(decode.address))
