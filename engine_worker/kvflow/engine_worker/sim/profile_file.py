"""Profiles as JSON files, and resolving ``--sim-profile`` (a shipped name or a path).

Schema ``kvflow-sim-profile/1``: the ``SimProfile`` fields, the timing as its own object in
seconds. ``kvflow profile`` writes these; any other field is refused, so a typo does not
silently fall back to a default.
"""

from __future__ import annotations

import json
from dataclasses import asdict, fields
from pathlib import Path
from typing import Any

from kvflow.engine_worker.sim.profiles import SHIPPED, SimProfile, named_profile
from kvflow.proto.step_model import StepTiming

SCHEMA = "kvflow-sim-profile/1"


class ProfileError(ValueError):
    """A profile name or file that cannot be used; the message says what to do."""


def profile_to_dict(profile: SimProfile) -> dict[str, Any]:
    return {"schema": SCHEMA, **asdict(profile)}


def profile_from_dict(data: dict[str, Any], where: str) -> SimProfile:
    if data.get("schema") != SCHEMA:
        raise ProfileError(f"{where}: expected schema {SCHEMA!r}, got {data.get('schema')!r}")
    body = {k: v for k, v in data.items() if k != "schema"}
    known = {f.name for f in fields(SimProfile)}
    unknown = set(body) - known
    missing = known - set(body)
    if unknown or missing:
        raise ProfileError(
            f"{where}: unknown fields {sorted(unknown)}, missing fields {sorted(missing)}"
        )
    timing = body.pop("timing")
    try:
        if not isinstance(timing, dict):
            raise TypeError("timing must be an object")
        return SimProfile(timing=StepTiming(**timing), **body)
    except (TypeError, ValueError) as exc:
        raise ProfileError(f"{where}: {exc}") from None


def write_profile(profile: SimProfile, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(profile_to_dict(profile), indent=2) + "\n")


def read_profile(path: str | Path) -> SimProfile:
    try:
        data = json.loads(Path(path).read_text())
    except OSError as exc:
        raise ProfileError(f"cannot read profile {path}: {exc.strerror}") from None
    except json.JSONDecodeError as exc:
        raise ProfileError(f"{path}: not JSON ({exc.msg} at line {exc.lineno})") from None
    if not isinstance(data, dict):
        raise ProfileError(f"{path}: expected a JSON object")
    return profile_from_dict(data, str(path))


def resolve_profile(name_or_path: str) -> SimProfile:
    """A roofline profile by name (``h100-llama3-8b``...) or a profile file by path."""
    if name_or_path.endswith(".json") or "/" in name_or_path:
        return read_profile(name_or_path)
    try:
        profile = named_profile(name_or_path)
    except ValueError as exc:  # a model that does not fit on those GPUs
        raise ProfileError(f"profile {name_or_path!r}: {exc}") from None
    if profile is None:
        raise ProfileError(
            f"unknown profile {name_or_path!r}: use one of {', '.join(SHIPPED)} "
            "(or <gpu>[x<N>]-<model>), or the path of a file `kvflow profile` wrote"
        )
    return profile
