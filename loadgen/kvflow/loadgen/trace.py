"""Mooncake-format request traces: one JSON object per line, validated field by field.

Format (Mooncake FAST'25 release): ``timestamp`` (ms from the trace's start),
``input_length`` and ``output_length`` (tokens), ``hash_ids`` (one id per 512-token block
of the prompt, the last one possibly partial; equal ids are the same content, so a prefix
cache can reuse them). Any other field is ignored. A malformed line is an error naming the
file, the line number and the field, never a silently skipped request: a trace with holes
would replay a different load than the one it claims.
"""

from __future__ import annotations

import json
import math
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

# The Mooncake FAST'25 synthetic trace that ships in the repository (traces/, Apache-2.0):
# the simulator's and the benchmarks' default (a source checkout; an installed package
# names its trace with --trace).
MOONCAKE_TRACE = (
    Path(__file__).resolve().parents[3] / "traces" / "mooncake-fast25" / "synthetic_trace.jsonl"
)
MOONCAKE_BLOCK_TOKENS = 512


class TraceError(ValueError):
    """A trace line that cannot be replayed; the message says where and why."""


@dataclass(frozen=True, slots=True)
class TraceRecord:
    timestamp_ms: float
    input_length: int
    output_length: int
    hash_ids: tuple[int, ...]


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _field(obj: dict[str, Any], name: str, where: str) -> object:
    if name not in obj:
        raise TraceError(f"{where}: missing field {name!r}")
    return obj[name]


def _positive_int(obj: dict[str, Any], name: str, where: str) -> int:
    value = _field(obj, name, where)
    if not _is_int(value) or value < 1:  # type: ignore[operator]
        raise TraceError(f"{where}: field {name!r} must be an integer >= 1, got {value!r}")
    return value  # type: ignore[return-value]


def parse_trace_line(
    line: str, where: str, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> TraceRecord:
    """One line; ``where`` (e.g. ``trace.jsonl line 7``) prefixes every error message."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as exc:
        raise TraceError(f"{where}: not valid JSON ({exc.msg} at column {exc.colno})") from None
    if not isinstance(obj, dict):
        raise TraceError(f"{where}: expected a JSON object, got {type(obj).__name__}")
    timestamp = _field(obj, "timestamp", where)
    if not isinstance(timestamp, int | float) or isinstance(timestamp, bool):
        raise TraceError(f"{where}: field 'timestamp' must be a number (ms), got {timestamp!r}")
    if not math.isfinite(timestamp) or timestamp < 0:
        raise TraceError(f"{where}: field 'timestamp' must be finite and >= 0, got {timestamp!r}")
    input_length = _positive_int(obj, "input_length", where)
    output_length = _positive_int(obj, "output_length", where)
    hash_ids = _field(obj, "hash_ids", where)
    if not isinstance(hash_ids, list) or not all(_is_int(h) and h >= 0 for h in hash_ids):
        raise TraceError(
            f"{where}: field 'hash_ids' must be a list of integers >= 0, got {hash_ids!r:.80}"
        )
    num_blocks = math.ceil(input_length / block_tokens)
    if len(hash_ids) > num_blocks:
        raise TraceError(
            f"{where}: field 'hash_ids' has {len(hash_ids)} ids, more than the "
            f"{num_blocks} blocks of {block_tokens} tokens that input_length {input_length} fills"
        )
    return TraceRecord(float(timestamp), input_length, output_length, tuple(hash_ids))


def parse_trace(
    lines: Iterable[str], source: str, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS
) -> list[TraceRecord]:
    """Every record of a trace; blank lines are skipped, timestamps must not go back."""
    records: list[TraceRecord] = []
    for line_no, line in enumerate(lines, start=1):
        if not line.strip():
            continue
        where = f"{source} line {line_no}"
        record = parse_trace_line(line, where, block_tokens=block_tokens)
        if records and record.timestamp_ms < records[-1].timestamp_ms:
            raise TraceError(
                f"{where}: field 'timestamp' goes back in time ({record.timestamp_ms:g} ms "
                f"after {records[-1].timestamp_ms:g} ms); sort the trace by timestamp"
            )
        records.append(record)
    if not records:
        raise TraceError(f"{source}: the trace has no requests")
    return records


def load_trace(path: str | Path, *, block_tokens: int = MOONCAKE_BLOCK_TOKENS) -> list[TraceRecord]:
    """Read and parse a trace file; a missing file is a TraceError too."""
    try:
        with open(path, encoding="utf-8") as f:
            return parse_trace(f, str(path), block_tokens=block_tokens)
    except OSError as exc:
        raise TraceError(f"cannot read trace {path}: {exc.strerror}") from None
    except UnicodeDecodeError as exc:
        raise TraceError(f"{path}: not UTF-8 text ({exc.reason})") from None
