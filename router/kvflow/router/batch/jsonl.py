"""A batch's input file read into lines, and the output and error files' lines. Pure.

Each input line is one request: ``{"custom_id": ..., "method": "POST", "url": <the batch's
endpoint>, "body": {...}}``. A file that is not such lines fails the batch at validation
(OpenAI's ``errors``, with the line number); a line whose body the endpoint refuses lands in
the error file with that refusal, as any request's would, and the batch goes on.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvflow.router.protocol.strict_json import NotJsonTextError, loads_strict

MAX_CUSTOM_ID_CHARS = 512


@dataclass(frozen=True)
class BatchLine:
    index: int  # 0-based, in file order: the key results are stored under
    custom_id: str
    body: dict[str, Any]


@dataclass(frozen=True)
class Parsed:
    lines: tuple[BatchLine, ...]
    errors: tuple[dict[str, Any], ...]  # OpenAI's errors.data entries; any: the batch fails


def _problem(code: str, message: str, line: int | None) -> dict[str, Any]:
    return {"code": code, "message": message, "param": None, "line": line}


def parse_input(content: bytes, endpoint: str, max_lines: int) -> Parsed:
    """Every line checked; up to 10 problems named (enough to fix a file, not a flood)."""
    errors: list[dict[str, Any]] = []
    lines: list[BatchLine] = []
    seen: set[str] = set()
    try:
        text = content.decode("utf-8-sig")  # a BOM, as editors on Windows write one, is no line
    except UnicodeDecodeError:
        return Parsed((), (_problem("invalid_file", "The file is not UTF-8 text.", None),))
    raw_lines = [(n, s) for n, s in enumerate(text.splitlines(), start=1) if s.strip()]
    if not raw_lines:
        return Parsed((), (_problem("empty_file", "The input file has no requests.", None),))
    if len(raw_lines) > max_lines:
        message = f"The input file has {len(raw_lines)} requests; at most {max_lines} allowed."
        return Parsed((), (_problem("too_many_requests", message, None),))
    for number, raw in raw_lines:
        problem = _check_line(raw, endpoint, seen)
        if isinstance(problem, dict):
            errors.append(_problem(problem["code"], problem["message"], number))
            if len(errors) >= 10:
                break
            continue
        lines.append(BatchLine(len(lines), problem[0], problem[1]))
    return Parsed(tuple(lines) if not errors else (), tuple(errors))


def _check_line(
    raw: str, endpoint: str, seen: set[str]
) -> dict[str, str] | tuple[str, dict[str, Any]]:
    try:
        entry = loads_strict(raw)
    except NotJsonTextError as exc:
        # A lone surrogate or a NaN is refused as the HTTP API refuses it in a body; left in,
        # a surrogate failed every pass of the runner and the batch never ended.
        where = "" if exc.where is None else f" (at {exc.where})"
        message = f"This line is not valid JSON: {exc}{where}."
        return {"code": "invalid_json_line", "message": message}
    except RecursionError:  # left uncaught, the batch stayed "validating" for good
        message = "This line is not valid JSON: it nests too deeply to parse."
        return {"code": "invalid_json_line", "message": message}
    if not isinstance(entry, dict):
        return {"code": "invalid_request", "message": "Each line must be a JSON object."}
    custom_id = entry.get("custom_id")
    if not isinstance(custom_id, str) or not custom_id:
        return {"code": "missing_required_parameter", "message": "custom_id is required."}
    if len(custom_id) > MAX_CUSTOM_ID_CHARS:
        message = f"custom_id is longer than {MAX_CUSTOM_ID_CHARS} characters."
        return {"code": "invalid_value", "message": message}
    if custom_id in seen:
        message = f"custom_id {custom_id!r} is used by an earlier line; each must be unique."
        return {"code": "duplicate_custom_id", "message": message}
    seen.add(custom_id)
    if entry.get("method") != "POST":
        return {"code": "invalid_value", "message": "method must be POST."}
    if entry.get("url") != endpoint:
        message = f"url must be the batch's endpoint {endpoint}, got {entry.get('url')!r}."
        return {"code": "mismatched_url", "message": message}
    body = entry.get("body")
    if not isinstance(body, dict):
        return {"code": "invalid_value", "message": "body must be a JSON object."}
    return custom_id, body


def result_line(
    line: BatchLine, request_id: str, status_code: int, body: dict[str, Any]
) -> dict[str, Any]:
    """A line of the output file (2xx) or the error file: the response as a client would
    have had it."""
    return {"id": f"batch_req_{request_id}", "custom_id": line.custom_id,
            "response": {"status_code": status_code, "request_id": request_id, "body": body},
            "error": None}  # fmt: skip


def unrun_line(line: BatchLine, code: str, message: str) -> dict[str, Any]:
    """A line of the error file for a request never run (batch_expired, batch_cancelled)."""
    return {"id": f"batch_req_unrun_{line.index}", "custom_id": line.custom_id,
            "response": None, "error": {"code": code, "message": message}}  # fmt: skip


def result_files(
    lines: Sequence[BatchLine], results: Mapping[int, tuple[bool, str]], *, is_cancelled: bool
) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """A finished batch's output and error files' entries, in its lines' order: each stored
    result in its file, each line never run as cancelled or expired."""
    outputs: list[dict[str, Any]] = []
    errors: list[dict[str, Any]] = []
    for line in lines:
        found = results.get(line.index)
        if found is not None:
            (outputs if found[0] else errors).append(json.loads(found[1]))
        elif is_cancelled:
            message = "The batch was cancelled before this request ran."
            errors.append(unrun_line(line, "batch_cancelled", message))
        else:
            errors.append(unrun_line(line, "batch_expired", "This request could not be "
                                     "executed before the completion window expired."))  # fmt: skip
    return outputs, errors


def dump_lines(entries: list[dict[str, Any]]) -> bytes:
    return b"".join(json.dumps(e, separators=(",", ":")).encode() + b"\n" for e in entries)
