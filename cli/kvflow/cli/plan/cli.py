"""`kvflow plan`: the options, the files they name, and the report (docs/plan.md).

Exit status: 0 a plan was printed; 2 bad options or input, with a message saying what to
change (an unknown GPU lists the known ones; a model that does not fit says how much memory
is missing and what would make it fit).
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path
from typing import TextIO

import yaml

from kvflow.cli.plan.deployment import Deployment
from kvflow.cli.plan.errors import PlanError
from kvflow.cli.plan.gpus import BUILTIN, GpuOffer, extend_catalog, find_gpu
from kvflow.cli.plan.model_files import read_model_path
from kvflow.cli.plan.models import DTYPE_BYTES, PRESETS, ModelSpec, from_flags, preset
from kvflow.cli.plan.plan import PlanInputs, make_plan
from kvflow.cli.plan.report import render_table, to_json
from kvflow.cli.plan.workload import Slo, Target, parse_mix, workload
from kvflow.engine_worker.sim.profile_file import ProfileError, resolve_profile
from kvflow.engine_worker.sim.profiles import Efficiency
from kvflow.proto.cli_args import is_positive

_SHAPE_FLAGS = ("params_b", "layers", "heads", "kv_heads", "head_dim")


def build_parser() -> argparse.ArgumentParser:
    eff = Efficiency()
    p = argparse.ArgumentParser(
        prog="kvflow plan",
        description="Size a deployment: memory, step times, GPUs and cost for a model and load.",
    )
    m = p.add_argument_group("model (a preset, a folder or GGUF file, or flags)")
    m.add_argument("--model", help=f"preset ({', '.join(PRESETS)}), model folder or .gguf file")
    m.add_argument("--params-b", type=float, help="parameters, in billions")
    m.add_argument("--layers", type=int)
    m.add_argument("--heads", type=int, help="attention (query) heads")
    m.add_argument("--kv-heads", type=int, help="key/value heads (grouped-query attention)")
    m.add_argument("--head-dim", type=int)
    m.add_argument("--max-context", type=int, help="the model's context length (flags only)")
    m.add_argument(
        "--weight-dtype",
        choices=DTYPE_BYTES,
        help="weights' precision (default: what the file stores, else bf16)",
    )
    m.add_argument("--kv-dtype", choices=[d for d in DTYPE_BYTES if d != "int4"], default="bf16")
    g = p.add_argument_group("hardware")
    g.add_argument("--gpu", required=True, help=f"one of {', '.join(BUILTIN)} or from --gpu-file")
    g.add_argument("--gpu-file", type=Path, help="YAML/JSON adding GPU types or prices")
    g.add_argument("--gpu-price-per-hour", type=float, help="USD per GPU-hour, for cost")
    g.add_argument("--tp", type=int, default=1, help="GPUs per replica (tensor parallelism)")
    g.add_argument("--redundancy", type=int, default=0, help="spare replicas on top of the load")
    w = p.add_argument_group("traffic and SLOs")
    w.add_argument("--input-tokens", type=int, default=1024)
    w.add_argument("--output-tokens", type=int, default=256)
    w.add_argument("--mix", help="IN:OUT[:SHARE],... instead of --input/--output-tokens")
    load = w.add_mutually_exclusive_group()
    load.add_argument("--concurrency", type=int, help="concurrent requests to serve")
    load.add_argument("--rate", type=float, help="requests per second to serve")
    w.add_argument("--ttft-ms", type=float, help="time-to-first-token SLO (longest prompt)")
    w.add_argument("--tpot-ms", type=float, help="time-per-output-token SLO")
    e = p.add_argument_group("engine")
    e.add_argument(
        "--profile",
        help="step times from a kvflow profile JSON or a sim profile "
        "name (e.g. h100-llama3-8b) instead of the roofline",
    )
    e.add_argument("--gpu-memory-utilization", type=float, default=eff.memory_utilization)
    e.add_argument(
        "--overhead-gb",
        type=float,
        default=eff.activation_bytes_per_gpu / 1e9,
        help="per GPU: activations, CUDA graphs, communication buffers",
    )
    e.add_argument("--bandwidth-efficiency", type=float, default=eff.memory)
    e.add_argument("--mfu", type=float, default=eff.compute, help="prefill model FLOPs utilisation")
    e.add_argument("--tp-efficiency", type=float, default=eff.tensor_parallel)
    e.add_argument("--step-overhead-ms", type=float, default=eff.step_overhead_s * 1e3)
    e.add_argument("--max-num-seqs", type=int, default=256)
    e.add_argument("--max-num-batched-tokens", type=int, default=8192)
    d = p.add_argument_group("disaggregation")
    d.add_argument(
        "--disaggregated",
        action="store_true",
        help="also size a prefill pool by TTFT and a decode pool by TPOT (xPyD)",
    )
    d.add_argument(
        "--kv-link-gb-s",
        type=float,
        default=25.0,
        help="prefill -> decode KV bandwidth per replica, GB/s (default 25: a 200 Gb/s NIC)",
    )
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    return p  # fmt: skip


def _model(args: argparse.Namespace) -> ModelSpec:
    given = [f"--{f.replace('_', '-')}" for f in _SHAPE_FLAGS if getattr(args, f) is not None]
    if args.model is not None:
        if args.max_context is not None:
            given.append("--max-context")
        if given:
            raise PlanError(f"--model and {', '.join(given)} both describe the model: give one")
        found = preset(args.model)
        if found is not None:
            return found
        path = Path(args.model)
        if not path.exists():
            raise PlanError(
                f"--model {args.model!r} is neither a preset ({', '.join(PRESETS)}) nor an "
                "existing folder or .gguf file"
            )
        return read_model_path(path)
    if len(given) < len(_SHAPE_FLAGS):
        raise PlanError(
            "describe the model: --model PRESET|FOLDER|FILE.gguf, or all of --params-b, "
            "--layers, --heads, --kv-heads and --head-dim"
        )
    return from_flags(
        params_b=args.params_b, num_layers=args.layers, num_heads=args.heads,
        num_kv_heads=args.kv_heads, head_dim=args.head_dim, max_context_tokens=args.max_context,
    )  # fmt: skip


def _gpu(args: argparse.Namespace) -> GpuOffer:
    catalog = dict(BUILTIN)
    if args.gpu_file is not None:
        try:
            data = yaml.safe_load(args.gpu_file.read_text())
        except OSError as exc:
            raise PlanError(f"cannot read --gpu-file {args.gpu_file}: {exc.strerror}") from None
        except yaml.YAMLError as exc:
            raise PlanError(f"{args.gpu_file}: not YAML or JSON ({exc})") from None
        catalog = extend_catalog(catalog, data, str(args.gpu_file))
    offer = find_gpu(args.gpu, catalog)
    if args.gpu_price_per_hour is not None:
        if not is_positive(args.gpu_price_per_hour):
            raise PlanError("--gpu-price-per-hour must be > 0")
        offer = replace(offer, price_per_gpu_hour=args.gpu_price_per_hour)
    return offer


def inputs_from_args(args: argparse.Namespace) -> PlanInputs:
    model = _model(args)
    if args.weight_dtype is not None:
        weight_dtype, weight_bytes = args.weight_dtype, DTYPE_BYTES[args.weight_dtype]
    elif model.stored_bytes_per_param is not None:
        weight_bytes = model.stored_bytes_per_param
        weight_dtype = f"as stored, {weight_bytes * 8:.2f} bits"
    else:
        weight_dtype, weight_bytes = "bf16", DTYPE_BYTES["bf16"]
    eff = Efficiency(
        memory=args.bandwidth_efficiency, compute=args.mfu, tensor_parallel=args.tp_efficiency,
        step_overhead_s=args.step_overhead_ms / 1e3,
        memory_utilization=args.gpu_memory_utilization,
        activation_bytes_per_gpu=args.overhead_gb * 1e9,
    )  # fmt: skip
    dep = Deployment(
        gpu=_gpu(args), tp=args.tp, weight_dtype=weight_dtype, weight_bytes_per_param=weight_bytes,
        kv_dtype=args.kv_dtype, kv_bytes_per_value=DTYPE_BYTES[args.kv_dtype], eff=eff,
        max_num_seqs=args.max_num_seqs, max_num_batched_tokens=args.max_num_batched_tokens,
        redundancy_replicas=args.redundancy,
    )  # fmt: skip
    work = parse_mix(args.mix) if args.mix else workload(args.input_tokens, args.output_tokens)
    ms = 1e-3
    slo = Slo(
        ttft_s=None if args.ttft_ms is None else args.ttft_ms * ms,
        tpot_s=None if args.tpot_ms is None else args.tpot_ms * ms,
    )
    if not is_positive(args.kv_link_gb_s):
        raise PlanError(f"--kv-link-gb-s must be > 0, got {args.kv_link_gb_s}")
    profile = None
    if args.profile is not None:
        try:
            profile = resolve_profile(args.profile)
        except ProfileError as exc:
            raise PlanError(str(exc)) from None
    return PlanInputs(
        model=model, work=work, dep=dep, target=Target(args.concurrency, args.rate), slo=slo,
        profile=profile, profile_label=args.profile or "",
        disaggregated=args.disaggregated, kv_link_bytes_per_s=args.kv_link_gb_s * 1e9,
    )  # fmt: skip


def main(argv: Sequence[str], out: TextIO = sys.stdout, err: TextIO = sys.stderr) -> int:
    args = build_parser().parse_args(list(argv))
    try:
        plan = make_plan(inputs_from_args(args))
    except PlanError as exc:
        print(f"kvflow plan: {exc}", file=err)
        return 2
    if args.json:
        print(json.dumps(to_json(plan), indent=2), file=out)
    else:
        print(render_table(plan), file=out)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
