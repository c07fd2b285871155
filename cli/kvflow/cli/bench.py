"""`kvflow bench`: run a load ladder against an OpenAI-compatible endpoint and report it.

The table goes to stdout, the progress line to stderr. Exit 0 when the run completed
(slow or invalid load points are results, not failures), 1 when no request succeeded at
all (the endpoint is not serving: the error kinds say why), 2 for bad options or a bad
trace.
"""

from __future__ import annotations

import asyncio
import os
import sys
from collections.abc import Sequence
from typing import Any, TextIO
from urllib.parse import urlsplit

import httpx

from kvflow.loadgen.client import BenchClient
from kvflow.loadgen.ladder import LadderPlan, run_ladder
from kvflow.loadgen.metrics import Slo
from kvflow.loadgen.options import (
    DEFAULT_DURATION_S,
    OptionError,
    build_workload,
    load_points,
    parse,
)
from kvflow.loadgen.payloads import Api, EndpointConfig
from kvflow.loadgen.report_json import report_dict, write_json
from kvflow.loadgen.report_table import render_report
from kvflow.loadgen.summary import LoadPointSummary, ScheduleLimits
from kvflow.loadgen.trace import TraceError


def base_url(url: str) -> str:
    """``http://host:port`` and ``http://host:port/v1`` both mean the ``/v1`` API."""
    url = url.rstrip("/")
    return url + "/v1" if urlsplit(url).path in ("", "/") else url


def discover_model(url: str, api_key: str | None) -> str:
    headers = {"authorization": f"Bearer {api_key}"} if api_key else {}
    try:
        response = httpx.get(f"{url}/models", headers=headers, timeout=30)
        response.raise_for_status()
        models = response.json()["data"]
        return str(models[0]["id"])
    except (httpx.HTTPError, ValueError, KeyError, IndexError, TypeError) as exc:
        raise OptionError(f"cannot list models at {url}/models ({exc}); pass --model") from None


async def _run(
    config: EndpointConfig, plan: LadderPlan, out: TextIO | None
) -> list[LoadPointSummary]:
    client = BenchClient(config)
    try:
        return await run_ladder(client, plan, out)
    finally:
        await client.aclose()


def main(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    if argv[:1] == ["sim"]:  # the same options against a simulated cluster, in virtual time
        from kvflow.sim.run_cli import main as sim_main

        return sim_main(argv[1:], out, err)
    args = parse(argv)
    try:
        points = load_points(args)
        workload = build_workload(args)
        url = base_url(args.url)
        api_key = args.api_key or os.environ.get("OPENAI_API_KEY")
        model = args.model or discover_model(url, api_key)
    except (OptionError, TraceError, ValueError) as exc:
        print(f"kvflow bench: {exc}", file=err)
        return 2
    duration_s = args.duration_s
    if duration_s is None and (args.workload != "trace" or args.users or args.rates):
        duration_s = DEFAULT_DURATION_S  # only a trace's own clock has a natural end
    slo = Slo(ttft_s=args.slo_ttft_ms / 1e3, tpot_s=args.slo_tpot_ms / 1e3)
    plan = LadderPlan(
        workload=workload,
        points=points,
        seed=args.seed,
        warmup_s=args.warmup_s,
        duration_s=duration_s,
        max_requests=args.max_requests,
        slo=slo,
        limits=ScheduleLimits(max_lag_s=args.max_lag_ms / 1e3),
        block_size=args.block_size,
    )
    config = EndpointConfig(
        base_url=url,
        model=model,
        api=Api(args.api),
        api_key=api_key,
        ignore_eos=not args.no_ignore_eos,
        request_timeout_s=args.request_timeout_s,
        ask_route=args.route_header,
    )
    print(f"kvflow bench: {workload.name} against {config.url} (model {model!r}), "
          f"{len(points)} load point(s)", file=err, flush=True)  # fmt: skip
    try:
        summaries = asyncio.run(_run(config, plan, None if args.quiet else err))
    except KeyboardInterrupt:
        print("\nkvflow bench: interrupted; no report", file=err)
        return 130
    print(render_report(summaries, slo), file=out, flush=True)
    recorded: dict[str, Any] = {
        k: v for k, v in vars(args).items() if k != "api_key" and not k.startswith("_")
    }
    recorded.update(model=model, url=url, duration_s=duration_s)
    report = report_dict(summaries, slo, recorded)
    if args.json:
        write_json(args.json, report)
        print(f"kvflow bench: wrote {args.json}", file=err)
    if args.plot:
        try:
            from kvflow.loadgen.plots import plot_ladders
        except ModuleNotFoundError as exc:
            print(f"kvflow bench: --plot needs {exc.name}: pip install matplotlib", file=err)
            return 2
        plot_ladders({workload.name: summaries}, slo, args.plot, f"kvflow bench: {workload.name}")
        print(f"kvflow bench: wrote {args.plot}", file=err)
    if refuses_ignore_eos(summaries):
        print("kvflow bench: the server refuses ignore_eos; pass --no-ignore-eos", file=err)
    if not any(s.throughput.num_ok for s in summaries):
        print("kvflow bench: no request succeeded; see the errors above", file=err)
        return 1
    return 0


def refuses_ignore_eos(summaries: Sequence[LoadPointSummary]) -> bool:
    """A 400 naming ``ignore_eos`` (OpenAI's own API and some servers do not take it)."""
    return any("ignore_eos" in s.throughput.error_examples.get("http_400", "") for s in summaries)
