"""A model's own sampling defaults: what its publisher recommends, read from its files. Pure.

A Hugging Face folder keeps them in ``generation_config.json`` (``temperature``, ``top_p``,
``top_k``, ``min_p``, ``repetition_penalty``, and ``max_new_tokens`` for the length); a GGUF
file converted by a recent llama.cpp keeps the same values as ``general.sampling.*``
metadata. vLLM applies these as the defaults of every request (its ``--generation-config
auto``); so does the gateway, per field, only where the request leaves the field out.

A value outside the range a request may ask for is dropped with a warning instead of
failing the gateway's start: the model's files are not the operator's to fix.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping
from dataclasses import dataclass, fields, replace
from typing import Any

log = logging.getLogger("kvflow.router.text")

# generation_config.json key -> (field, low, high); the ranges are the request's own.
_HF_KEYS = {
    "temperature": ("temperature", 0.0, 2.0),
    "top_p": ("top_p", 0.0, 1.0),
    "top_k": ("top_k", 0, 2**31 - 1),
    "min_p": ("min_p", 0.0, 1.0),
    "repetition_penalty": ("repetition_penalty", 1e-9, 1e9),
    "max_new_tokens": ("max_tokens", 1, 2**31 - 1),
}
# llama.cpp's GGUF keys -> the generation_config.json names (its converter copies the
# values over); GGUF has no length default.
_GGUF_KEYS = {
    "general.sampling.temp": "temperature",
    "general.sampling.top_p": "top_p",
    "general.sampling.top_k": "top_k",
    "general.sampling.min_p": "min_p",
    "general.sampling.penalty_repeat": "repetition_penalty",
}
_INTEGER_FIELDS = ("top_k", "max_tokens")


@dataclass(frozen=True)
class SamplingDefaults:
    """Defaults for the fields a request leaves out; None: no default (OpenAI's applies)."""

    temperature: float | None = None
    top_p: float | None = None
    top_k: int | None = None
    min_p: float | None = None
    repetition_penalty: float | None = None
    max_tokens: int | None = None

    def as_dict(self) -> dict[str, float | int]:
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not None}

    def over(self, base: SamplingDefaults) -> SamplingDefaults:
        """These values where set, ``base``'s elsewhere."""
        return replace(base, **self.as_dict())  # type: ignore[arg-type]


NO_DEFAULTS = SamplingDefaults()


def _checked(name: str, value: Any, where: str) -> float | int | None:
    field_name, low, high = _HF_KEYS[name]
    is_integer = field_name in _INTEGER_FIELDS
    is_number = not isinstance(value, bool) and isinstance(value, int | float)
    in_range = is_number and low <= value <= high
    if name == "top_p" and value == 0:  # keeps no token: a request may not ask for it either
        in_range = False
    if not in_range or (is_integer and value != int(value)):
        opening = "(" if name == "top_p" else "["
        log.warning("%s: ignoring %s=%r (expected a number in %s%s, %s])",
                    where, name, value, opening, low, high)  # fmt: skip
        return None
    return int(value) if is_integer else float(value)


def from_generation_config(config: Mapping[str, Any], where: str) -> SamplingDefaults:
    """The defaults a ``generation_config.json`` holds (most hold none: only token ids)."""
    values: dict[str, float | int] = {}
    for name, (field_name, _, _) in _HF_KEYS.items():
        if config.get(name) is not None:
            checked = _checked(name, config[name], where)
            if checked is not None:
                values[field_name] = checked
    # top_k 0 is "off" in transformers; as a default it changes nothing.
    if values.get("top_k") == 0:
        del values["top_k"]
    return SamplingDefaults(**values)  # type: ignore[arg-type]


def from_gguf_metadata(metadata: Mapping[str, Any], where: str) -> SamplingDefaults:
    """The defaults in a GGUF file's ``general.sampling.*`` metadata."""
    as_hf = {name: metadata[key] for key, name in _GGUF_KEYS.items() if key in metadata}
    return from_generation_config(as_hf, where)
