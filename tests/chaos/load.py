"""The soak's clients: seeded mixed requests (chat and legacy completions, streaming or
not, three tenants) sent like a client behind a load balancer with two gateway replicas,
and a verdict on every request.

A client here does what a sane one does and no more: a refused connection goes to the
other replica at once (the load balancer's health check), a 503 with Retry-After is
retried after it, a request cut because its replica was SIGKILLed is sent once more to
the other. Everything else is recorded as it came. Verdicts starting with "bad:" are the
ones the soak must never see.
"""

from __future__ import annotations

import asyncio
import json
import random
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import httpx

from chaos.cluster import MODEL, TENANT_QUOTAS, api_key

HUNG_AFTER_S = 60.0  # a request with no answer by then is hung
MAX_RETRIES = 4  # per request, of all kinds
EJECT_S = 2.0
SHARED_PREFIX = "You are the chaos monkey's assistant. Keep every answer short. " * 3


@dataclass(frozen=True)
class Spec:
    tenant: str
    chat: bool
    stream: bool
    max_tokens: int
    prompt: str
    abandon: bool = False  # a streaming client that hangs up after its first token

    def body(self) -> dict[str, Any]:
        body: dict[str, Any] = {"model": MODEL, "max_tokens": self.max_tokens,
                                "ignore_eos": True, "temperature": 0}  # fmt: skip
        if self.chat:
            body["messages"] = [{"role": "user", "content": self.prompt}]
        else:
            body["prompt"] = self.prompt
        if self.stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        return body


def random_spec(rng: random.Random) -> Spec:
    tenant = rng.choice(list(TENANT_QUOTAS))
    words = " ".join(rng.choice(["alpha", "beta", "gamma", "delta", "omega", "kappa"])
                     for _ in range(rng.randint(3, 60)))  # fmt: skip
    # Half the prompts share a prefix, so cached blocks are shared, evicted and reused.
    prompt = (SHARED_PREFIX if rng.random() < 0.5 else "") + words
    stream = rng.random() < 0.5
    # Some clients hang up mid-stream: the gateway must abort the request on its worker
    # and the worker free its blocks (the checkpoints look for leaks).
    abandon = stream and rng.random() < 0.1
    # Mostly short answers; one in five long enough to be running when something dies.
    max_tokens = rng.randint(32, 96) if rng.random() < 0.2 else rng.randint(2, 16)
    return Spec(tenant, rng.random() < 0.5, stream, max_tokens, prompt, abandon)


@dataclass
class Attempt:
    """What one HTTP attempt came to: a verdict, and a retry hint."""

    verdict: str
    retry: str | None = None  # "other-router" or "after:<seconds>"
    response_ids: list[str] = field(default_factory=list)


def _judge_usage(spec: Spec, usage: dict[str, Any] | None, finish: str | None, n: int) -> str:
    tokens = usage.get("completion_tokens") if usage else None
    if n > spec.max_tokens or (tokens is not None and tokens > spec.max_tokens):
        return f"bad:duplicated (chunks={n} usage={tokens} max={spec.max_tokens})"
    if finish != "length" or tokens != spec.max_tokens:
        return f"bad:wrong-answer (finish={finish} usage={tokens})"
    return "ok"


async def _plain(
    client: httpx.AsyncClient, url: str, spec: Spec, headers: dict[str, str]
) -> Attempt:
    r = await client.post(url, json=spec.body(), headers=headers)
    if r.status_code != 200:
        return _refusal(r.status_code, r.headers, r.text)
    body = r.json()
    choices = body.get("choices") or []
    if len(choices) != 1:
        return Attempt(f"bad:wrong-answer ({len(choices)} choices)")
    verdict = _judge_usage(spec, body.get("usage"), choices[0].get("finish_reason"), 0)
    return Attempt(verdict, response_ids=[body.get("id", "")])


async def _stream(
    client: httpx.AsyncClient, url: str, spec: Spec, headers: dict[str, str]
) -> Attempt:
    async with client.stream("POST", url, json=spec.body(), headers=headers) as r:
        if r.status_code != 200:
            return _refusal(r.status_code, r.headers, (await r.aread()).decode(errors="replace"))
        usage, finish, done, num_chunks, ids = None, None, False, 0, set()
        texts: list[str] = []
        async for line in r.aiter_lines():
            if line == "data: [DONE]":
                done = True
            elif line.startswith("data: "):
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    err = chunk["error"]
                    return Attempt(f"stream-error:{err.get('code') or err.get('type')}")
                ids.add(chunk.get("id", ""))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices") or ():
                    finish = choice.get("finish_reason") or finish
                    delta = choice.get("delta", {}).get("content") if spec.chat else None
                    text = delta if spec.chat else choice.get("text")
                    # A token that ends in a partial UTF-8 sequence can give two chunks: its
                    # text now, and U+FFFD flushed at the end; only the first is a token.
                    if text and set(text) != {"\ufffd"}:
                        num_chunks += 1
                        texts.append(text)
                        if spec.abandon:
                            return Attempt("abandoned")  # leaving the block hangs up
        if not done:
            return Attempt("cut", retry="other-router")  # the body ended without [DONE]
        if len(ids) != 1:
            return Attempt(f"bad:duplicated ({len(ids)} ids in one stream)")
        verdict = _judge_usage(spec, usage, finish, num_chunks)
        if verdict != "ok":
            verdict += f" {texts!r}"
        return Attempt(verdict, response_ids=list(ids))


def _error_code(text: str) -> str:
    try:
        error = json.loads(text)["error"]
        return str(error.get("code") or error.get("type"))
    except (ValueError, KeyError, TypeError, AttributeError):
        return "unparsed"


def _refusal(status: int, headers: httpx.Headers, text: str) -> Attempt:
    if status == 429:
        return Attempt("rate-limited")
    if status == 503:
        after = headers.get("retry-after")
        if after and after.isdigit():
            return Attempt(f"clean-503:{_error_code(text)} {text[:200]}", retry=f"after:{after}")
        return Attempt(f"bad:503-without-retry-after {text[:120]}")
    if status >= 500:
        return Attempt(f"bad:{status} {text[:120]}")
    return Attempt(f"bad:unexpected-{status} {text[:120]}")


@dataclass
class Tally:
    """Counts of final verdicts and of what clients did on the way."""

    verdicts: Counter[str] = field(default_factory=Counter)
    events: Counter[str] = field(default_factory=Counter)
    examples: dict[str, str] = field(default_factory=dict)
    response_ids: Counter[str] = field(default_factory=Counter)
    latencies_s: list[float] = field(default_factory=list)

    def record(self, verdict: str, detail: str) -> None:
        key = verdict.split(" ", maxsplit=1)[0]
        self.verdicts[key] += 1
        self.examples.setdefault(key, f"{verdict} | {detail}"[:600])

    @property
    def num_requests(self) -> int:
        return sum(self.verdicts.values())

    def duplicate_ids(self) -> int:
        return sum(n - 1 for n in self.response_ids.values() if n > 1)


class LoadClient:
    """Sends one logical request at a time, failing over between the router replicas.

    ``killed_during(kind, t0, t1)`` (the chaos log) tells whether a part of that kind was
    killed while a request ran: only then is a cut or an in-band error explained."""

    def __init__(self, router_urls: list[str], tally: Tally,
                 killed_during: Callable[[str, float, float], bool]) -> None:  # fmt: skip
        self.router_urls, self.tally, self.killed_during = router_urls, tally, killed_during
        self._next = 0
        # Like a load balancer's outlier detection: a replica that refused a connection
        # gets no traffic for a moment.
        self._ejected_until_s: dict[str, float] = {}

    def _pick(self) -> str:
        """The next replica in turn, skipping ejected ones (unless all are)."""
        now = time.monotonic()
        urls = [u for u in self.router_urls if self._ejected_until_s.get(u, 0.0) <= now]
        urls = urls or self.router_urls
        self._next += 1
        return urls[self._next % len(urls)]

    async def send(self, client: httpx.AsyncClient, spec: Spec) -> None:
        started = time.monotonic()
        try:
            verdict, detail = await asyncio.wait_for(self._send(client, spec), HUNG_AFTER_S)
        except TimeoutError:
            verdict, detail = "bad:hung", f"no answer within {HUNG_AFTER_S} s"
        self.tally.latencies_s.append(time.monotonic() - started)
        self.tally.record(verdict, f"{spec} | {detail}")

    async def _send(self, client: httpx.AsyncClient, spec: Spec) -> tuple[str, str]:
        headers = {"authorization": f"Bearer {api_key(spec.tenant)}"}
        path = "/v1/chat/completions" if spec.chat else "/v1/completions"
        history: list[str] = []
        for _ in range(MAX_RETRIES + 1):
            base = self._pick()
            t0 = time.monotonic()
            try:
                call = _stream if spec.stream else _plain
                attempt = await call(client, base + path, spec, headers)
            except httpx.ConnectError:
                attempt = Attempt("refused", retry="other-router")
            except httpx.ConnectTimeout:  # a replica too busy to accept: the LB moves on
                attempt = Attempt("connect-timeout", retry="other-router")
            except (httpx.RemoteProtocolError, httpx.ReadError, httpx.WriteError) as exc:
                attempt = Attempt(f"cut {type(exc).__name__}", retry="other-router")
            except httpx.HTTPError as exc:  # anything else is recorded, never a dead client
                return f"bad:transport-{type(exc).__name__}", str(history)
            t1 = time.monotonic()
            if attempt.retry == "other-router":
                self._ejected_until_s[base] = t1 + EJECT_S
            self.tally.response_ids.update(attempt.response_ids)
            verdict = attempt.verdict
            if verdict.startswith("cut") and not self.killed_during("router", t0, t1):
                return "bad:lost", f"{verdict} with no router killed; {history}"
            if verdict.startswith("stream-error"):
                explained = self.killed_during("worker", t0, t1)
                return (f"clean-stream-error-after-kill {verdict}" if explained
                        else f"bad:unexplained-{verdict}"), str(history)  # fmt: skip
            history.append(verdict.split(" ")[0])
            if attempt.retry is None:
                if history[:-1]:
                    self.tally.events["answered-after-retries"] += 1
                return verdict, str(history)
            self.tally.events[history[-1]] += 1
            self.tally.examples.setdefault(f"event {history[-1]}", verdict[:300])
            if attempt.retry.startswith("after:"):
                # Obey Retry-After, but a soak has no minute to spare: at most 1 s.
                await asyncio.sleep(min(1.0, float(attempt.retry[6:])))
        return f"gave-up-after-retries {history[-1]}", str(history)


async def run_clients(load: LoadClient, num_clients: int, seed: int, stop: asyncio.Event) -> None:
    """``num_clients`` closed loops of seeded random requests until ``stop``."""

    async def loop(i: int) -> None:
        rng = random.Random(seed * 1000 + i)
        timeout = httpx.Timeout(HUNG_AFTER_S, connect=2.0)
        limits = httpx.Limits(max_keepalive_connections=0)  # a new connection per request
        async with httpx.AsyncClient(timeout=timeout, limits=limits) as client:
            while not stop.is_set():
                await load.send(client, random_spec(rng))

    await asyncio.gather(*(loop(i) for i in range(num_clients)))
