"""Simulated workers slow enough to overload on purpose, and a client that posts in waves.

One request at a time at 20 ms a step: a request of n tokens holds its worker n * 20 ms,
so queues build at a few requests per second and an overload test's timings stay far
apart on a busy machine.
"""

from __future__ import annotations

import asyncio

import httpx

MODEL = "sim"
SIM_ARGS = ["--simulate", "--served-model-name", MODEL, "--sim-base-step-ms", "20",
            "--max-num-seqs", "1", "--num-kv-blocks", "1024"]  # fmt: skip


def sim_args(model: str = MODEL) -> list[str]:
    """``SIM_ARGS`` serving ``model``."""
    args = [*SIM_ARGS]
    args[args.index(MODEL)] = model
    return args


def body(max_tokens: int, model: str = MODEL) -> dict[str, object]:
    return {"model": model, "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": max_tokens, "ignore_eos": True}  # fmt: skip


async def post_all(
    url: str, bodies: list[dict[str, object]], key: str = "sk-none", *, delay_s: float = 0.0
) -> list[httpx.Response]:
    """POST every body at once (after ``delay_s``); the responses in order."""
    await asyncio.sleep(delay_s)
    headers = {"authorization": f"Bearer {key}"}
    async with httpx.AsyncClient(timeout=120) as client:
        return list(await asyncio.gather(*(
            client.post(f"{url}/v1/chat/completions", json=b, headers=headers) for b in bodies
        )))  # fmt: skip
