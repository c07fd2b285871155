"""A plan as a table for the terminal, or as JSON (the same numbers, SI units in the names)."""

from __future__ import annotations

from dataclasses import asdict
from typing import Any

from kvflow.cli.plan.plan import Plan
from kvflow.cli.plan.steps import bandwidth_floor_step_s, compute_floor_prefill_s

GB = 1e9


def notes(plan: Plan) -> list[str]:
    inputs = plan.inputs
    said = [
        f"step times from {'a measured or simulated ' if plan.steps.is_measured else 'the '}"
        f"{plan.steps.source}"
    ]
    if inputs.model.source == "flags":
        said.append("model from flags: every parameter counted as multiplied per token")
    if plan.fleet.cost_per_hour is None:
        said.append("no GPU price: pass --gpu-price-per-hour (or price_per_gpu_hour in --gpu-file)")
    if plan.interference is not None:
        x = plan.interference
        said.append(
            f"prefill interference binds: at batch {x.batch} the prompts' prefill adds "
            f"{x.prefill_share_s * 1e3:.1f} ms to each {x.step_s * 1e3:.1f} ms step; a decode "
            f"step with no prompts in it meets the TPOT SLO up to batch {x.decode_only_batch}"
            + ("" if plan.disagg else ": --disaggregated sizes prefill and decode pools")
        )
    if plan.disagg is not None:
        said.append(
            "disaggregated: prefill queueing is M/D/1 at the pool's utilisation; the colocated "
            "plan above models no queueing"
        )
    else:
        said.append("queueing before admission is not modelled; TTFT is for the longest prompt")
    return said


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:,.2f} ms"


def _usd(value: float | None, unit: str) -> str:
    return (
        "-" if value is None else f"${value:,.4f} {unit}" if value < 1 else f"${value:,.2f} {unit}"
    )


def render_table(plan: Plan) -> str:
    i, mem, rep, fleet = plan.inputs, plan.memory, plan.replica, plan.fleet
    dep, work, t = i.dep, i.work, plan.steps.timing
    mix = ", ".join(f"{c.input_tokens}:{c.output_tokens} ({c.share:.0%})" for c in work.classes)
    if i.target.concurrency is not None:
        target = f"{i.target.concurrency} concurrent requests"
    elif i.target.rate_per_s is not None:
        target = f"{i.target.rate_per_s:g} requests/s"
    else:
        target = "none (one replica at its limit)"
    slo = ", ".join(
        f"{name} {value * 1e3:g} ms"
        for name, value in (("TTFT", i.slo.ttft_s), ("TPOT", i.slo.tpot_s))
        if value is not None
    )
    sections: list[tuple[str, list[tuple[str, str]]]] = [
        ("inputs", [
            ("model", f"{i.model.name} ({i.model.source}), "
                      f"{i.model.num_params / 1e9:.2f} B params"),
            ("replica", f"{dep.tp} x {dep.gpu_name}, {dep.weight_dtype} weights, "
                        f"{dep.kv_dtype} KV"),
            ("mix (in:out tokens)", mix),
            ("target", target),
            ("SLO", slo or "none"),
        ]),
        ("memory per replica", [
            ("GPU memory", f"{mem.gpu_memory_bytes / GB:,.1f} GB, "
                           f"{dep.eff.memory_utilization:.0%} usable: "
                           f"{mem.usable_bytes / GB:,.1f} GB"),
            ("weights", f"{mem.weight_bytes / GB:,.2f} GB"),
            ("overhead", f"{mem.overhead_bytes / GB:,.1f} GB"),
            ("KV cache", f"{mem.kv_pool_bytes / GB:,.2f} GB = {mem.kv_capacity_tokens:,} tokens"),
            ("KV per token", f"{mem.kv_bytes_per_token:,.0f} bytes"),
            ("KV per request", f"{mem.kv_bytes_per_request / 1e6:,.1f} MB"),
            ("max concurrency", f"{mem.max_concurrency:,} requests"),
        ]),
        ("step times", [
            ("decode step, batch 1", _ms(t.base_step_s + t.per_decode_seq_s
                                         + t.per_kv_token_s * work.read_context_tokens)),
            ("prefill, longest prompt", _ms(plan.steps.prefill_s(work.max_input_tokens))),
        ]),
        ("one replica at its limit", [
            ("batch limits", ", ".join(f"{k} {v:,}" for k, v in rep.batch_limits.items())),
            ("max batch", f"{rep.max_batch:,} (bound by {rep.binding})"),
            ("TPOT / TTFT", f"{_ms(rep.tpot_s)} / {_ms(rep.ttft_s)}"),
            ("throughput", f"{rep.output_tokens_per_s:,.0f} output tokens/s, "
                           f"{rep.requests_per_s:,.2f} requests/s"),
        ]),
        ("fleet", [
            ("replicas by constraint", ", ".join(
                f"{k} {v}" for k, v in fleet.replicas_by_constraint.items())),
            ("replicas", f"{fleet.replicas_for_load} + {fleet.redundancy_replicas} spare "
                         f"= {fleet.num_replicas}"),
            ("GPUs", f"{fleet.num_gpus}"),
            ("at the target", f"batch {fleet.batch_per_replica:,.1f} per replica, TPOT "
                              f"{_ms(fleet.tpot_s)}, TTFT {_ms(fleet.ttft_s)}"),
            ("throughput", f"{fleet.output_tokens_per_s:,.0f} output tokens/s"),
            ("cost", _usd(fleet.cost_per_hour, "per hour")),
            ("per 1M output tokens", _usd(fleet.cost_per_million_output_tokens, "")),
            ("per 1M tokens (in+out)", _usd(fleet.cost_per_million_tokens, "")),
        ]),
    ]  # fmt: skip
    if plan.disagg is not None:
        sections.append(("disaggregated (prefill and decode pools)", _disagg_rows(plan)))
    lines = [f"kvflow plan: {i.model.name} on {dep.tp} x {dep.gpu_name}"]
    for title, rows in sections:
        lines += ["", title]
        lines += [f"  {label:<26} {value}".rstrip() for label, value in rows]
    lines += ["", "notes"] + [f"  - {note}" for note in notes(plan)]
    return "\n".join(lines)


def _disagg_rows(plan: Plan) -> list[tuple[str, str]]:
    d, i, fleet = plan.disagg, plan.inputs, plan.fleet
    assert d is not None
    p, dec, work = d.prefill, d.decode, i.work
    floor_s = bandwidth_floor_step_s(i.model, i.dep, dec.batch_per_replica, work.max_context_tokens)
    eff = i.dep.eff
    colocated_gpus = fleet.num_gpus - fleet.redundancy_replicas * i.dep.tp
    prefill_floor_s = compute_floor_prefill_s(i.model, i.dep, work.max_input_tokens)
    return [
        ("replicas (xPyD)", f"{d.ratio}: {p.replicas} prefill + {dec.replicas} decode = "
                            f"{d.num_gpus} GPUs (colocated: {colocated_gpus})"),
        ("prefill replica", f"{p.requests_per_s_at_full:,.2f} requests/s when busy; "
                            f"{p.max_utilization:.0%} busy at most (bound by {p.bound_by})"),
        ("prefill at the target", f"{p.utilization:.0%} busy, TTFT {_ms(p.ttft_s)} "
                                  f"(KV transfer {_ms(p.transfer_s)})"),
        ("prefill, compute floor", f"{_ms(prefill_floor_s)} at {eff.compute:.0%} MFU "
                                   "(matmuls only)"),
        ("decode batch limits", ", ".join(f"{k} {v:,}" for k, v in dec.batch_limits.items())
                                + f" (bound by {dec.bound_by})"),
        ("decode at the target", f"batch {dec.batch_per_replica:,.1f} per replica, "
                                 f"TPOT {_ms(dec.tpot_s)}"),
        ("decode step, floor", f"{_ms(floor_s)} at full bandwidth, {_ms(floor_s / eff.memory)} at "
                               f"{eff.memory:.0%} (weights + batch x {work.max_context_tokens:,} "
                               "tokens of KV)"),
        ("throughput", f"{d.output_tokens_per_s:,.0f} output tokens/s, "
                       f"{d.requests_per_s:,.2f} requests/s"),
        ("cost", _usd(d.cost_per_hour, "per hour")),
        ("per 1M output tokens", _usd(d.cost_per_million_output_tokens, "")),
    ]  # fmt: skip


def to_json(plan: Plan) -> dict[str, Any]:
    i = plan.inputs
    return {
        "schema": "kvflow-plan/1",
        "model": asdict(i.model),
        "deployment": asdict(i.dep),
        "workload": {
            "classes": [asdict(c) for c in i.work.classes],
            "mean_input_tokens": i.work.mean_input_tokens,
            "mean_output_tokens": i.work.mean_output_tokens,
        },
        "target": asdict(i.target),
        "slo": asdict(i.slo),
        "memory": asdict(plan.memory),
        "step_timing": {
            **asdict(plan.steps.timing),
            "source": plan.steps.source,
            "is_measured": plan.steps.is_measured,
        },
        "replica": asdict(plan.replica),
        "fleet": asdict(plan.fleet),
        "interference": None if plan.interference is None else asdict(plan.interference),
        "disaggregated": None
        if plan.disagg is None
        else {**asdict(plan.disagg), "ratio": plan.disagg.ratio},
        "notes": notes(plan),
    }
