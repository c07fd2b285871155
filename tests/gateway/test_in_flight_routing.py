"""The gateway remembers the prompts it just sent (routing/in_flight.py), before the
workers' KV events confirm them. The fake workers here publish no STORED events at all, so
what the index holds is exactly that memory: a prompt's followers go where it went, but
only on workers that advertise a prefix cache, and never to a worker that just failed it."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

import httpx
import pytest
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway

pytestmark = pytest.mark.integration

PROMPT = list(range(1000, 1064))  # four full blocks of 16 tokens
NUM_REQUESTS = 12


@contextmanager
def gateway_over(*workers: FakeWorker) -> Iterator[GatewayProcess]:
    with ExitStack() as stack:
        addresses = [stack.enter_context(running_fake_worker(w)) for w in workers]
        g = stack.enter_context(running_gateway(["--workers", ",".join(addresses),
                                                 "--seed", "3"]))  # fmt: skip
        g.wait_ready(num_workers=len(addresses))
        yield g


def complete(g: GatewayProcess, prompt: list[int]) -> None:
    r = httpx.post(f"{g.base_url}/completions", timeout=30,
                   json={"model": "fake", "prompt": prompt, "max_tokens": 4})  # fmt: skip
    assert r.status_code == 200, r.text


def counts(*workers: FakeWorker) -> list[int]:
    return [len(w.requests) for w in workers]


def test_a_prompt_follows_the_worker_it_was_just_sent_to() -> None:
    a, b = FakeWorker(prefix_caching=True), FakeWorker(prefix_caching=True)
    with gateway_over(a, b) as g:
        for _ in range(NUM_REQUESTS):
            complete(g, PROMPT)
        # Idle, equal workers and no KV events: only the memory of the first placement
        # separates them; without it ties go to the worker chosen least recently, 6 and 6.
        # (One slip is allowed: on a loaded machine a health probe that times out takes a
        # worker out for a moment.)
        assert max(counts(a, b)) >= NUM_REQUESTS - 1
        # Distinct prompts share no block, so the same gateway spreads them.
        for i in range(NUM_REQUESTS):
            complete(g, [7 + i, *PROMPT])
        assert min(counts(a, b)) >= 2


def test_workers_without_a_prefix_cache_are_not_credited() -> None:
    a, b = FakeWorker(prefix_caching=False), FakeWorker(prefix_caching=False)
    with gateway_over(a, b) as g:
        for _ in range(NUM_REQUESTS):
            complete(g, PROMPT)
        # They would never store the prompt: each repeat is a fresh tie, broken at random.
        assert min(counts(a, b)) >= 2


def test_a_worker_that_failed_the_prompt_does_not_draw_its_repeats() -> None:
    # b looks busier, so a cold prompt goes to a first; a's queue is full (it stays healthy)
    # and b serves it.
    a = FakeWorker(prefix_caching=True, mode="busy")
    b = FakeWorker(prefix_caching=True, num_running=1)
    with gateway_over(a, b) as g:
        for _ in range(NUM_REQUESTS):
            complete(g, PROMPT)  # every one answered (failed over to b when tried on a)
        # Had a kept its claim, it would outscore b (same blocks, shorter queue) every time;
        # and its load report (nothing running) says it is the cheaper worker: the router
        # holds a worker that refused with a full queue aside for a second (pool.py,
        # refused_busy), whatever its last report said.
        assert counts(a, b) == [1, NUM_REQUESTS]
