"""GPU types by name: the built-in datasheets, extended or priced by a user's file.

The datasheet numbers live in one place, ``kvflow.engine_worker.sim.hardware``; this module
only names them and reads the user's additions. A file (YAML or JSON, same schema)::

    gpus:
      mi300x:                     # a new type: the three datasheet fields are required
        memory_gb: 192
        memory_bandwidth_gb_s: 5300
        bf16_tflops: 1307
        price_per_gpu_hour: 3.50  # optional, USD
      h100:
        price_per_gpu_hour: 2.49  # a known type: any field overrides the built-in one
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Any

from kvflow.cli.plan.errors import PlanError
from kvflow.engine_worker.sim.hardware import (
    A100_40GB,
    A100_80GB,
    GB,
    H100_SXM,
    H200_SXM,
    L40S,
    RTX_4090,
    GpuSpec,
)

# KV moves between prefill and decode hosts over a 200 Gb/s RDMA NIC at 85 %: the planner
# does not use the link, but a GpuSpec carries one.
_DEFAULT_KV_LINK_BYTES_PER_S = 0.85 * 200e9 / 8
_FILE_FIELDS = ("memory_gb", "memory_bandwidth_gb_s", "bf16_tflops", "price_per_gpu_hour")


@dataclass(frozen=True, slots=True)
class GpuOffer:
    """A GPU type as the plan uses it: its datasheet and, when known, what an hour costs."""

    key: str  # the name a user types
    spec: GpuSpec
    price_per_gpu_hour: float | None = None  # USD; None: cost is not computed


BUILTIN: dict[str, GpuOffer] = {
    key: GpuOffer(key, spec)
    for key, spec in (
        ("a100-40gb", A100_40GB),
        ("a100-80gb", A100_80GB),
        ("h100", H100_SXM),
        ("h200", H200_SXM),
        ("l40s", L40S),
        ("rtx-4090", RTX_4090),
    )
}


def _norm(name: str) -> str:
    return re.sub(r"[^a-z0-9]", "", name.lower())


def find_gpu(name: str, catalog: dict[str, GpuOffer]) -> GpuOffer:
    """The catalog entry called ``name`` (case, dashes and the datasheet name all match)."""
    wanted = _norm(name)
    for offer in catalog.values():
        if wanted in (_norm(offer.key), _norm(offer.spec.name)):
            return offer
    raise PlanError(
        f"unknown GPU {name!r}: use one of {', '.join(catalog)}, "
        "or describe it in a file passed with --gpu-file (see docs/plan.md)"
    )


def extend_catalog(catalog: dict[str, GpuOffer], data: Any, where: str) -> dict[str, GpuOffer]:
    """``catalog`` plus the ``gpus`` of a parsed GPU file; the input is left unchanged."""
    if (
        not isinstance(data, dict)
        or not isinstance(data.get("gpus"), dict)
        or set(data) != {"gpus"}
    ):
        raise PlanError(f"{where}: expected one top-level key 'gpus' mapping names to fields")
    merged = dict(catalog)
    for key, fields in data["gpus"].items():
        if not isinstance(fields, dict):
            raise PlanError(f"{where}: gpus.{key} must map field names to numbers")
        unknown = sorted(set(fields) - set(_FILE_FIELDS))
        if unknown:
            raise PlanError(f"{where}: gpus.{key}: unknown fields {unknown}; known: {_FILE_FIELDS}")
        for field, value in fields.items():
            if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
                raise PlanError(f"{where}: gpus.{key}.{field} = {value!r} must be a number > 0")
        try:
            base: GpuOffer | None = find_gpu(str(key), merged)
        except PlanError:
            base = None
        merged[base.key if base else str(key)] = _entry(str(key), fields, base, where)
    return merged


def _entry(key: str, fields: dict[str, float], base: GpuOffer | None, where: str) -> GpuOffer:
    price = fields.get("price_per_gpu_hour", base.price_per_gpu_hour if base else None)
    if base is None:
        missing = [f for f in _FILE_FIELDS[:3] if f not in fields]
        if missing:
            raise PlanError(f"{where}: new GPU {key!r} needs {missing}")
        spec = GpuSpec(
            name=key,
            peak_bf16_flops=fields["bf16_tflops"] * 1e12,
            hbm_bytes_per_s=fields["memory_bandwidth_gb_s"] * GB,
            hbm_bytes=fields["memory_gb"] * GB,
            kv_link_bytes_per_s=_DEFAULT_KV_LINK_BYTES_PER_S,
        )
        return GpuOffer(key, spec, price)
    spec = base.spec
    if "memory_gb" in fields:
        spec = replace(spec, hbm_bytes=fields["memory_gb"] * GB)
    if "memory_bandwidth_gb_s" in fields:
        spec = replace(spec, hbm_bytes_per_s=fields["memory_bandwidth_gb_s"] * GB)
    if "bf16_tflops" in fields:
        spec = replace(spec, peak_bf16_flops=fields["bf16_tflops"] * 1e12)
    return GpuOffer(base.key, spec, price)
