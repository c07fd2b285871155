"""One tenant's cached prefix is no use to another, and cannot be seen in the time to the
first token: a real gateway, a real engine worker on the built-in SmolLM2-135M, two
tenants whose cache salts differ (the default: one per tenant name).

Tenant A warms long prompts. Then, interleaved in a seeded random order per round:
- B sends a prompt A warmed (same tokens): no cached token, and its TTFT must match...
- ...B sending a fresh prompt of the same length, within what the noise allows;
- A repeats its own prompt: the positive control, a cache hit, much faster. It proves the
  measurement can see a hit at all; without it a broken timer would pass.

Prompts are token ids (legacy completions), so every prompt has exactly the same length.
"""

from __future__ import annotations

import json
import random
import statistics
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
import yaml
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.worker_process import WorkerProcess, launch_worker

from kvflow.router.tenants.config import hash_api_key

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "smol"
BLOCK_SIZE = 16
PROMPT_TOKENS = 768  # 48 blocks: a prefill long enough that a hit is unmistakable
NUM_ROUNDS = 8
KEYS = {"tenant-a": "sk-tenant-a-0123456789", "tenant-b": "sk-tenant-b-0123456789"}


@pytest.fixture(scope="module")
def worker() -> Iterator[WorkerProcess]:
    # Room for every prompt of the test (3 x 8 x 48 blocks): nothing is evicted, so a miss
    # can only come from the salt.
    w = launch_worker(["--served-model-name", MODEL, "--num-kv-blocks", "2048",
                       "--max-num-batched-tokens", "2048"], timeout_s=300)  # fmt: skip
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def gateway(
    worker: WorkerProcess, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[GatewayProcess]:
    tenants = [{"name": name, "api_key_sha256": hash_api_key(key)} for name, key in KEYS.items()]
    config: Path = tmp_path_factory.mktemp("tenants") / "router.yaml"
    config.write_text(yaml.safe_dump({"tenants": tenants}))
    g = launch_gateway(["--served-model-name", MODEL, "--workers", worker.address,
                        "--config", str(config)])  # fmt: skip
    try:
        g.wait_ready()
        yield g
    finally:
        g.stop()


def first_token(g: GatewayProcess, tenant: str, prompt: list[int]) -> tuple[float, int]:
    """(seconds to the first streamed token, cached prompt tokens the worker reported)."""
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 2, "ignore_eos": True,
            "temperature": 0, "stream": True,
            "stream_options": {"include_usage": True}}  # fmt: skip
    headers = {"authorization": f"Bearer {KEYS[tenant]}"}
    ttft_s, cached = None, None
    started = time.perf_counter()
    with httpx.stream("POST", f"{g.base_url}/completions", json=body, headers=headers,
                      timeout=120) as r:  # fmt: skip
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            if ttft_s is None and chunk.get("choices"):
                ttft_s = time.perf_counter() - started
            if chunk.get("usage"):
                cached = chunk["usage"]["prompt_tokens_details"]["cached_tokens"]
    assert ttft_s is not None and cached is not None
    return ttft_s, cached


def random_prompt(rng: random.Random) -> list[int]:
    # Ordinary vocabulary ids (SmolLM2's specials are the first few): any sequence will do.
    return [rng.randrange(1000, 40000) for _ in range(PROMPT_TOKENS)]


def median_tolerance_s(diffs: list[float]) -> float:
    """Three standard errors of the median of ``diffs``, from their own spread (MAD, robust
    to the odd slow sample on a shared machine). The differences are paired, each pair sent
    back to back, so the machine's slow drift in load cancels out of them."""
    mad = statistics.median(abs(d - statistics.median(diffs)) for d in diffs)
    return 3.0 * 1.2533 * 1.4826 * mad / len(diffs) ** 0.5


def test_another_tenants_cached_prefix_gives_no_hit_and_no_ttft_difference(
    gateway: GatewayProcess,
) -> None:
    rng = random.Random(2026)
    warmed = [random_prompt(rng) for _ in range(NUM_ROUNDS)]
    first_token(gateway, "tenant-b", random_prompt(rng))  # warm the code paths, not the cache
    for prompt in warmed:
        _, cached = first_token(gateway, "tenant-a", prompt)
        assert cached == 0  # nobody sent it before
    samples: dict[str, list[float]] = {"b-same": [], "b-fresh": [], "a-repeat": []}
    for prompt in warmed:
        fresh = random_prompt(rng)
        trials = [("b-same", "tenant-b", prompt), ("b-fresh", "tenant-b", fresh),
                  ("a-repeat", "tenant-a", prompt)]  # fmt: skip
        rng.shuffle(trials)  # no kind always runs first (or after a warm-up of the machine)
        for kind, tenant, tokens in trials:
            ttft_s, cached = first_token(gateway, tenant, tokens)
            samples[kind].append(ttft_s)
            if kind == "a-repeat":
                # Every full block but the one holding the last token comes from the cache.
                assert cached >= (PROMPT_TOKENS - 1) // BLOCK_SIZE * BLOCK_SIZE - BLOCK_SIZE
            else:
                assert cached == 0, f"{kind}: tenant B was served {cached} tokens from A's cache"
    med = {k: statistics.median(v) for k, v in samples.items()}
    report = {k: [round(x * 1000) for x in v] for k, v in samples.items()}
    diffs = [s - f for s, f in zip(samples["b-same"], samples["b-fresh"], strict=True)]
    tolerance_s = median_tolerance_s(diffs)
    print(f"TTFT medians (ms): { {k: round(v * 1000, 1) for k, v in med.items()} }, "
          f"paired difference b-same - b-fresh {statistics.median(diffs) * 1000:.1f} ms "
          f"(tolerance {tolerance_s * 1000:.1f} ms), samples {report}")  # fmt: skip
    # The positive control: a hit is plainly visible (a 768-token prefill vs one token).
    assert med["a-repeat"] < 0.5 * med["b-fresh"], report
    # No measurable difference: within three standard errors of the noise, and in any
    # case far from what a hit saves (a tenth of it).
    hit_saving_s = med["b-fresh"] - med["a-repeat"]
    bound_s = max(tolerance_s, 0.1 * hit_saving_s)
    assert abs(statistics.median(diffs)) <= bound_s, (diffs, bound_s, report)
