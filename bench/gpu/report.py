"""The GPU check's summary (targets against measurements) and its table. Pure: no torch."""

from __future__ import annotations

from typing import Any

# Issue 34's targets, judged only where they apply: the full plan on a CUDA device.
BATCH1_ROOFLINE_TARGET = 0.70  # of the HBM roofline, Llama-3-8B shape, bf16 (gpt-fast: 69 %)
THROUGHPUT_TARGET = 2.0  # kvflow / transformers' continuous batching at batch 64
TARGET_BATCH = "64"
PREFILL_MFU_TARGET = 0.50  # of the datasheet bf16 peak, an 8K prompt, Llama-3-8B shape


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, dict) or k not in d:
            return None
        d = d[k]
    return d


def summarize(report: dict[str, Any]) -> dict[str, Any]:
    stages = report["stages"]
    applies = report["meta"]["device"].startswith("cuda") and report["meta"]["size"] == "full"
    roof = _get(stages, "roofline", "result") or {}
    copy_bw = _get(stages, "env", "result", "copy_bytes_per_s")
    bytes_per_step = _get(roof, "roofline_datasheet", "bytes_per_step")
    measured_roofline = copy_bw / bytes_per_step if copy_bw and bytes_per_step else None
    # The target holds for kvflow as a user can run it: eager or with --cuda-graphs,
    # whichever is faster (both are reported).
    b1_arm = _best(roof, {"engine": ("engine",), "engine_graphs": ("engine_graphs",)},
                   "fraction_of_roofline")  # fmt: skip
    b1 = _get(roof, b1_arm, "fraction_of_roofline") if b1_arm else None
    engine_tps = _get(roof, b1_arm, "decode_tokens_per_s") if b1_arm else None
    row64 = _get(stages, "throughput", "result", "rows", TARGET_BATCH) or {}
    ratio_arm = _best(row64, {"kvflow": ("ratio",), "kvflow-graphs": ("ratio_graphs",)}, None)
    ratio = row64.get("ratio_graphs" if ratio_arm == "kvflow-graphs" else "ratio")
    cases = _get(stages, "parity", "result", "cases") or {}
    pair = _get(stages, "kv_transfer", "result", "pair") or {}
    io_rows = _get(stages, "kv_transfer", "result", "block_io") or []
    prefill = _get(stages, "prefill", "result", "shapes") or {}
    matmul = _get(stages, "env", "result", "matmul_flops", "flops")
    mfu = _get(prefill, "llama3-8b", "mfu_datasheet")
    graphs = _get(roof, "cuda_graphs") or {}
    graph_parity = [c.get("graphs", {}).get("ok") for c in cases.values() if "graphs" in c]
    return {
        "stages_ok": [n for n, s in stages.items() if s["status"] == "ok"],
        "stages_not_ok": {n: s["status"] for n, s in stages.items() if s["status"] != "ok"},
        "parity_passed": {k: c.get("passed") for k, c in cases.items()},
        "batch1_decode": {
            "target": BATCH1_ROOFLINE_TARGET,
            "arm": b1_arm,
            "fraction_of_datasheet_roofline": b1,
            "fraction_of_measured_copy_roofline": (
                engine_tps / measured_roofline if engine_tps and measured_roofline else None
            ),
            "applies": applies and roof.get("shape") == "llama3-8b",
            "met": None if b1 is None or not applies else b1 >= BATCH1_ROOFLINE_TARGET,
        },
        "throughput_batch64": {
            "target": THROUGHPUT_TARGET,
            "arm": ratio_arm,
            "ratio_vs_transformers": ratio,
            "applies": applies,
            "met": None if ratio is None or not applies else ratio >= THROUGHPUT_TARGET,
        },
        "prefill_8k": {
            "target": PREFILL_MFU_TARGET,
            "mfu_datasheet": {k: v.get("mfu_datasheet") for k, v in prefill.items()},
            # Against the matrix rate this device reached in the env stage.
            "fraction_of_measured_matmul": {
                k: v["achieved_flops"] / matmul
                for k, v in prefill.items()
                if matmul and "achieved_flops" in v
            },
            "applies": applies and "llama3-8b" in prefill,
            "met": None if mfu is None or not applies else mfu >= PREFILL_MFU_TARGET,
        },
        # On by default on CUDA if they win with parity: the same tokens at batch 1, every
        # parity case's graphed tokens within tolerance, and faster.
        "cuda_graphs": {
            "batch1_tokens_identical": graphs.get("tokens_identical"),
            "parity_cases_ok": all(graph_parity) if graph_parity else None,
            "batch1_speedup": graphs.get("speedup"),
            "faster": graphs.get("faster"),
            "default_on_recommended": (
                None
                if not graphs or not applies
                else bool(
                    graphs.get("tokens_identical")
                    and all(graph_parity)
                    and graphs.get("faster") == "on"
                )
            ),
        },
        "fp8": {
            arm: {
                "fraction_of_roofline": r.get("fraction_of_roofline"),
                "batch_tokens_per_s": r.get("batch_tokens_per_s"),
                "logit_error_of_spread": r.get("logit_error_of_spread"),
            }
            for arm, r in (_get(stages, "quant", "result", "arms") or {}).items()
            if "skipped" not in r
        },
        "gpu_tests": _get(stages, "gpu_tests", "result", "summary", "counts"),
        "profile": _get(stages, "profile", "result", "profile", "name"),
        "kv_block_io_verified": all(r.get("verified") for r in io_rows) if io_rows else None,
        "kv_pair": {
            t: (
                v.get("error")
                or v.get("skipped")
                or all(r.get("verified") for r in v.get("rows", []))
            )
            for t, v in pair.items()
        },
    }


def _best(d: dict[str, Any], arms: dict[str, tuple[str, ...]], key: str | None) -> str | None:
    """The arm whose value (at ``d[path]``, then ``[key]`` if given) is highest; None if
    no arm has one."""
    values = {}
    for arm, path in arms.items():
        v = _get(d, *path, *((key,) if key else ()))
        if isinstance(v, (int, float)):
            values[arm] = v
    return max(values, key=values.__getitem__) if values else None


def _f(x: Any, spec: str = ".1f") -> str:
    return "-" if x is None else format(x, spec)


def _pct(x: Any) -> str:
    return "-" if x is None else f"{100 * x:.0f} %"


def table(report: dict[str, Any]) -> str:
    meta, stages, summary = report["meta"], report["stages"], report["summary"]
    device = _get(stages, "env", "result", "device", "name") or meta["device"]
    out = [
        f"## kvflow GPU check: {device}, size {meta['size']}, "
        f"{meta['wall_s']:.0f} s (setup {_f(meta.get('setup_s'))} s)",
        "",
        "| stage | status | wall s | error |",
        "|---|---|---|---|",
    ]
    for name, s in stages.items():
        err = (s.get("result") or {}).get("error") or ", ".join(
            f"{k}: {v}" for k, v in ((s.get("result") or {}).get("errors") or {}).items()
        )
        out.append(f"| {name} | {s['status']} | {_f(s.get('wall_s'))} | {err[:160]} |")

    cases = _get(stages, "parity", "result", "cases") or {}
    if cases:
        out += [
            "",
            "### Parity with transformers (same weights, same dtype)",
            "",
            "| case | weights | prefill max abs logit diff | logit std | greedy identical "
            "| fewest leading tokens agreeing | max margin | tolerance | passed |",
            "|---|---|---|---|---|---|---|---|---|",
        ]
        for key, c in cases.items():
            if "prefill" not in c:
                out.append(f"| {key} | {c.get('skipped', '-')} |||||||| ")
                continue
            least = min((r["agree_leading"] for r in c["greedy"]), default=None)
            out.append(
                f"| {key} | {c['weights']} | {_f(c['prefill']['max_abs_diff'], '.3g')} | "
                f"{_f(c['prefill']['ref_logit_std'], '.3g')} | {c['all_identical']} | "
                f"{least} of {c['greedy'][0]['new_tokens']} | {_f(c['max_margin'], '.3g')} | "
                f"{_f(c['margin_tol'], '.3g')} | {c['passed']} |"
            )

    roof = _get(stages, "roofline", "result") or {}
    ceiling = roof.get("roofline_datasheet")
    if ceiling:
        copy_bw = _get(stages, "env", "result", "copy_bytes_per_s")
        measured = copy_bw / ceiling["bytes_per_step"] if copy_bw else None
        out += [
            "",
            f"### Batch-1 decode, {roof['shape']} {roof['dtype']}, mean context "
            f"{ceiling['mean_context']:.0f}: roofline {ceiling['tokens_per_s']:.0f} tok/s at "
            f"{ceiling['hbm_bytes_per_s'] / 1e12:.1f} TB/s (datasheet), "
            f"{_f(measured, '.0f')} tok/s at the measured copy bandwidth "
            f"({_f(copy_bw and copy_bw / 1e12, '.2f')} TB/s)",
            "",
            "| measure | tok/s | of datasheet roofline | of measured roofline |",
            "|---|---|---|---|",
        ]
        for key, label in (
            ("engine", "engine (what a request gets)"),
            ("engine_graphs", "engine with --cuda-graphs"),
            ("forward", "model forward, eager"),
            ("graph", "model forward, CUDA graph (what-if)"),
            ("transformers", "transformers generate"),
        ):
            r = roof.get(key)
            if r:
                tps = r.get("decode_tokens_per_s") or r.get("tokens_per_s")
                out.append(
                    f"| {label} | {_f(tps)} | {_pct(tps / ceiling['tokens_per_s'])} | "
                    f"{_pct(tps / measured if measured else None)} |"
                )

    rows = _get(stages, "throughput", "result", "rows") or {}
    if rows:
        tp = stages["throughput"]["result"]
        out += [
            "",
            f"### Throughput, {tp['shape']} {tp['dtype']}: output tok/s, all requests at once",
            "",
            "kvflow --cuda-graphs: its graphs already captured / counting the captures (on "
            "each bucket's first step, once per process)",
            "",
            "| batch | output tokens | kvflow | kvflow --cuda-graphs | transformers CB "
            "| ratio | ratio, graphs captured |",
            "|---|---|---|---|---|---|---|",
        ]
        for b in sorted(rows, key=int):
            r = rows[b]
            if "skipped" in r:
                out.append(f"| {b} | {r['skipped']} ||||||")
                continue
            graphed = (
                f"{_f(_get(r, 'kvflow-graphs', 'tokens_per_s_captured'))} / "
                f"{_f(_get(r, 'kvflow-graphs', 'tokens_per_s'))}"
            )
            out.append(
                f"| {b} | {r['output_tokens']} | {_f(_get(r, 'kvflow', 'tokens_per_s'))} | "
                f"{graphed} | {_f(_get(r, 'transformers', 'tokens_per_s'))} | "
                f"{_f(r.get('ratio'), '.2f')} | {_f(r.get('ratio_graphs'), '.2f')} |"
            )

    kv = _get(stages, "kv_transfer", "result") or {}
    if kv.get("block_io"):
        out += [
            "",
            "### KV block I/O in one process (GB/s of payload)",
            "",
            "| tokens | MiB | read_blocks | write_blocks | contiguous copy | staged to host "
            "| pinned D2H copy | verified |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for r in kv["block_io"]:
            out.append(
                f"| {r['tokens']} | {r['num_bytes'] / 2**20:.0f} | "
                f"{_f(r['read_blocks_gbps'])} | {_f(r['write_blocks_gbps'])} | "
                f"{_f(r['contiguous_copy_gbps'])} | {_f(r.get('staged_read_to_host_gbps'))} | "
                f"{_f(r.get('pinned_d2h_copy_gbps'))} | {r['verified']} |"
            )
    if kv.get("pair"):
        out += [
            "",
            "### KV transfer between two processes on one device (kvflow's agent)",
            "",
            "| transport | tokens | rep | GB/s | verified or error |",
            "|---|---|---|---|---|",
        ]
        for t, v in kv["pair"].items():
            for r in v.get("rows", []):
                out.append(
                    f"| {t} | {r['tokens']} | {r['rep']} | {_f(r.get('gbps'), '.2f')} | "
                    f"{r.get('error', '')[:160] or r.get('verified')} |"
                )
            if "error" in v or "skipped" in v:
                out.append(f"| {t} | | | | {(v.get('error') or v.get('skipped'))[:160]} |")

    out += _more_tables(stages)
    b1, tp64 = summary["batch1_decode"], summary["throughput_batch64"]
    pre, cg = summary["prefill_8k"], summary["cuda_graphs"]
    out += [
        "",
        "### Targets (issue 34)",
        "",
        f"- batch-1 decode >= {_pct(b1['target'])} of the HBM roofline (Llama-3-8B shape): "
        f"{_pct(b1['fraction_of_datasheet_roofline'])} ({b1['arm']}) -> "
        f"{'met' if b1['met'] else 'NOT met' if b1['met'] is False else 'not applicable here'}",
        f"- throughput at batch 64 >= {tp64['target']:.0f}x transformers' continuous batching: "
        f"{_f(tp64['ratio_vs_transformers'], '.2f')}x ({tp64['arm']}) -> "
        f"{'met' if tp64['met'] else 'NOT met' if tp64['met'] is False else 'not applicable here'}",
        f"- prefill of an 8K prompt >= {_pct(pre['target'])} MFU (Llama-3-8B shape): "
        f"{_pct(pre['mfu_datasheet'].get('llama3-8b'))} -> {_verdict(pre['met'])}",
        f"- CUDA graphs on by default if they win with parity: batch-1 tokens identical "
        f"{cg['batch1_tokens_identical']}, parity cases ok {cg['parity_cases_ok']}, speedup "
        f"{_f(cg['batch1_speedup'], '.2f')}x -> recommended "
        f"{'-' if cg['default_on_recommended'] is None else cg['default_on_recommended']}",
    ]
    return "\n".join(out)


def _verdict(met: bool | None) -> str:
    return "met" if met else "NOT met" if met is False else "not applicable here"


def _more_tables(stages: dict[str, Any]) -> list[str]:
    """The 70B slice's decode, the 8K prefill, the FP8 arms, the gpu tests and the profile."""
    out: list[str] = []
    roof = _get(stages, "roofline", "result") or {}
    for name, r in (roof.get("shapes") or {}).items():
        ceiling = r.get("roofline_datasheet")
        if not ceiling:
            out += ["", f"### Batch-1 decode, {name}: {r.get('skipped', 'no result')}"]
            continue
        out += [
            "",
            f"### Batch-1 decode, {name}: roofline {ceiling['tokens_per_s']:.0f} tok/s at "
            f"{ceiling['hbm_bytes_per_s'] / 1e12:.1f} TB/s (datasheet)",
            "",
            "| measure | tok/s | of datasheet roofline |",
            "|---|---|---|",
        ]
        for key in ("engine", "engine_graphs"):
            if key in r:
                out.append(
                    f"| {key} | {_f(r[key]['decode_tokens_per_s'])} | "
                    f"{_pct(r[key]['fraction_of_roofline'])} |"
                )
    pre = _get(stages, "prefill", "result") or {}
    if pre.get("shapes"):
        out += [
            "",
            f"### Prefill of a {pre['prompt_len']}-token prompt, {pre['dtype']}",
            "",
            "| shape | TTFT s | prompt tok/s | TFLOPS | MFU (datasheet bf16 peak) |",
            "|---|---|---|---|---|",
        ]
        for name, r in pre["shapes"].items():
            if "ttft_s" not in r:
                out.append(f"| {name} | {r.get('skipped', '-')} ||||")
                continue
            out.append(
                f"| {name} | {r['ttft_s']:.3f} | {r['prompt_tokens_per_s']:.0f} | "
                f"{r['achieved_flops'] / 1e12:.1f} | {_pct(r['mfu_datasheet'])} |"
            )
    quant = _get(stages, "quant", "result") or {}
    if quant.get("arms"):
        out += [
            "",
            f"### FP8 arms, {quant['shape']}",
            "",
            "| arm | weights | KV | batch-1 tok/s | of its roofline | batch tok/s "
            "| logit error / spread | greedy leading agreement |",
            "|---|---|---|---|---|---|---|---|",
        ]
        for arm, r in quant["arms"].items():
            if "skipped" in r:
                out.append(f"| {arm} | {r['skipped']} |||||||")
                continue
            out.append(
                f"| {arm} | {r['weights']} | {r['kv_cache']} | {_f(r['decode_tokens_per_s'])} | "
                f"{_pct(r['fraction_of_roofline'])} | {_f(r['batch_tokens_per_s'])} | "
                f"{_f(r['logit_error_of_spread'], '.3g')} | "
                f"{r['greedy_agree_leading_vs_baseline']} of {r['new_tokens']} |"
            )
    tests = _get(stages, "gpu_tests", "result", "summary")
    if tests:
        out += ["", f"### Tests marked gpu: {tests['counts']}"]
        out += [f"- FAILED {f['test']}: {f['message'][:200]}" for f in tests["failures"]]
    prof = _get(stages, "profile", "result", "profile")
    if prof:
        out += ["", f"### Simulator profile {prof['name']}", "", f"{prof['source']}"]
    return out
