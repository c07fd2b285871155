"""Where disaggregating one prompt starts to pay: the evidence for
`disaggregation.min_remote_prefill_tokens`.

One request at a time on an idle prefill + decode pair, prompts of several lengths, each
sent twice with new text: through a gateway that always disaggregates (the PD path:
reserve, Prefill, KV over the transport, the decode worker computes the last token) and
through one with disaggregation off (the decode worker prefills itself). Per length: the
TTFT of both paths, and the CPU seconds the decode worker spent on the request, which is
what a local prefill takes from the streams already running there.
"""

from __future__ import annotations

import asyncio
import statistics
from collections.abc import Sequence
from dataclasses import dataclass

from pd_real_pool import Pool, counter_delta, pd_counters, process_cpu_s, wait_idle
from pd_real_traffic import Arrival, Kind, requests_for

from kvflow.loadgen.client import BenchClient
from kvflow.loadgen.payloads import Api, EndpointConfig, encode_body
from kvflow.loadgen.runner import start_clock

PD_GATEWAY = "always-pd"
LOCAL_GATEWAY = "local-prefill"
PATHS = {"pd": PD_GATEWAY, "local": LOCAL_GATEWAY}
# One token: the decode worker's CPU seconds then cover the prompt and nothing after it.
# (A first token that is part of a multi-byte character would send no text and show up
# as a `no_output` error; English-word prompts have not produced one.)
NUM_OUTPUT_TOKENS = 1


@dataclass(frozen=True)
class Sample:
    path: str  # "pd" or "local"
    num_prompt_tokens: int  # asked
    reported_prompt_tokens: int | None  # the server's usage.prompt_tokens
    ttft_s: float | None
    error: str | None
    decode_cpu_s: float
    prefill_cpu_s: float
    is_disaggregated: bool  # what the gateway's counters say it did


async def _one(pool: Pool, path: str, num_tokens: int, repetition: int, model_name: str) -> Sample:
    gateway = pool.gateways[PATHS[path]]
    config = EndpointConfig(f"{gateway.url}/v1", model_name, api=Api.COMPLETIONS,
                            request_timeout_s=300)  # fmt: skip
    [request] = requests_for(
        [Arrival(0.0, Kind.LONG, num_tokens, NUM_OUTPUT_TOKENS)],
        f"threshold/{path}/{num_tokens}/{repetition}",
    )
    client = BenchClient(config)
    decode, prefill = pool.workers["decode"].proc.pid, pool.workers["prefill"].proc.pid
    try:
        counters = pd_counters(gateway)
        cpu = (process_cpu_s(decode), process_cpu_s(prefill))
        record = await client.send(request.request_id, encode_body(config, request),
                                   scheduled_s=None, now=start_clock())  # fmt: skip
        cpu_after = (process_cpu_s(decode), process_cpu_s(prefill))
        delta = counter_delta(counters, pd_counters(gateway))
    finally:
        await client.aclose()
    shipped = any(k.startswith("kvflow_router_pd_transfers_total") and "outcome=sent" in k
                  for k in delta)  # fmt: skip
    return Sample(path, num_tokens, record.num_prompt_tokens, record.ttft_s, record.error,
                  round(cpu_after[0] - cpu[0], 3), round(cpu_after[1] - cpu[1], 3),
                  shipped)  # fmt: skip


def _median(values: Sequence[float]) -> float | None:
    return statistics.median(values) if values else None


def sweep(pool: Pool, sizes: Sequence[int], repetitions: int, model_name: str) -> dict[str, object]:
    """Every size, ``repetitions`` times, the two paths alternating which goes first."""
    pair = [pool.workers["prefill"], pool.workers["decode"]]
    # Warm both paths (torch's first run of each shape, the pair's gloo group).
    for path in PATHS:
        asyncio.run(_one(pool, path, max(sizes), -1, model_name))
    samples: list[Sample] = []
    for rep in range(repetitions):
        for n in sizes:
            order = ("pd", "local") if (rep + n) % 2 == 0 else ("local", "pd")
            for path in order:
                wait_idle(pair)
                samples.append(asyncio.run(_one(pool, path, n, rep, model_name)))
    rows = []
    for n in sizes:
        reported = {s.reported_prompt_tokens for s in samples if s.num_prompt_tokens == n}
        row: dict[str, object] = {
            "prompt_tokens": n,
            "reported_prompt_tokens": sorted(x for x in reported if x is not None),
        }
        for path in PATHS:
            mine = [s for s in samples if s.path == path and s.num_prompt_tokens == n]
            ttfts = [s.ttft_s for s in mine if s.ttft_s is not None]
            row[path] = {
                "ttft_s": _median(ttfts),
                "ttft_all_s": [round(t, 4) for t in ttfts],
                "decode_cpu_s": _median([s.decode_cpu_s for s in mine]),
                "prefill_cpu_s": _median([s.prefill_cpu_s for s in mine]),
                "num_disaggregated": sum(s.is_disaggregated for s in mine),
                "errors": [s.error for s in mine if s.error is not None],
            }
        pd, local = row["pd"], row["local"]
        assert isinstance(pd, dict) and isinstance(local, dict)
        if pd["ttft_s"] is not None and local["ttft_s"] is not None:
            row["pd_over_local"] = round(pd["ttft_s"] / local["ttft_s"], 3)
            row["pd_extra_ttft_s"] = round(pd["ttft_s"] - local["ttft_s"], 4)
            row["decode_cpu_saved_s"] = round(local["decode_cpu_s"] - pd["decode_cpu_s"], 3)
        rows.append(row)
    return {"sizes": list(sizes), "repetitions": repetitions, "rows": rows,
            "crossover_tokens": crossover(rows)}  # fmt: skip


def crossover(rows: Sequence[dict[str, object]]) -> int | None:
    """The shortest prompt from which on the PD path's median TTFT is no worse than the
    local one at every longer length measured; None when it never is."""
    found: int | None = None
    for row in reversed(rows):
        ratio = row.get("pd_over_local")
        if not isinstance(ratio, float) or ratio > 1.0:
            break
        found = int(str(row["prompt_tokens"]))
    return found
