"""The Batch API's pure parts: the state machine, the input file's checks, the upload's
multipart form, and the batch price factor."""

from __future__ import annotations

import asyncio
import json
from fractions import Fraction
from pathlib import Path

import pytest

from kvflow.router.batch.jsonl import parse_input
from kvflow.router.batch.multipart import MultipartError, boundary_of, parse_multipart
from kvflow.router.batch.records import FILE_PURPOSE, BatchRecord, Counts, FileRecord, Status
from kvflow.router.batch.store import DirBatchStore
from kvflow.router.tenants.money import discounted_pusd

CHAT = "/v1/chat/completions"


def _record() -> BatchRecord:
    return BatchRecord("batch-1", "a", CHAT, "file-1", "24h", 100, 200)


def test_the_state_machine_allows_openais_moves_only() -> None:
    r = _record()
    r = r.moved(Status.IN_PROGRESS, 101, total=3)
    r = r.moved(Status.FINALIZING, 150).moved(Status.COMPLETED, 151)
    assert r.status.is_terminal
    body = r.to_openai(Counts(3, 2, 1))
    assert (body["in_progress_at"], body["finalizing_at"], body["completed_at"]) == (101, 150, 151)
    assert body["request_counts"] == {"total": 3, "completed": 2, "failed": 1}
    with pytest.raises(ValueError):
        r.moved(Status.IN_PROGRESS, 152)  # a finished batch never runs again
    with pytest.raises(ValueError):
        _record().moved(Status.COMPLETED, 101)  # never without finalizing
    finalizing = _record().moved(Status.IN_PROGRESS, 1).moved(Status.FINALIZING, 2)
    for status in (Status.IN_PROGRESS, Status.CANCELLING):  # its lines are over
        with pytest.raises(ValueError):
            finalizing.moved(status, 3)
    assert _record().moved(Status.CANCELLING, 5).moved(Status.CANCELLED, 6).status.is_terminal
    assert BatchRecord.loads(r.dumps()) == r


def test_a_record_a_newer_router_wrote_still_loads() -> None:
    """A rolling upgrade shares one store: a field added since is left aside, not a 500."""
    r = _record().moved(Status.IN_PROGRESS, 1)
    newer = {**json.loads(r.dumps()), "priority": "high"}
    assert BatchRecord.loads(json.dumps(newer)) == r
    file = FileRecord("file-1", "a", "in.jsonl", FILE_PURPOSE, 10, 1)
    assert FileRecord.loads(json.dumps({**json.loads(file.dumps()), "sha256": "x"})) == file


def _line(custom_id: str, url: str = CHAT, **extra: object) -> str:
    return json.dumps({"custom_id": custom_id, "method": "POST", "url": url,
                       "body": {"model": "m"}, **extra})  # fmt: skip


def test_input_lines_are_checked_and_numbered() -> None:
    good = parse_input(f"{_line('a')}\n\n{_line('b')}\n".encode(), CHAT, 10)
    assert [(ln.index, ln.custom_id) for ln in good.lines] == [(0, "a"), (1, "b")]
    assert good.errors == ()
    bad = parse_input(
        "\n".join([_line("a"), _line("a"), _line("c", "/v1/completions"), "{nope",
                   json.dumps({"custom_id": "d", "method": "GET", "url": CHAT, "body": {}}),
                   json.dumps({"method": "POST", "url": CHAT, "body": {}})]).encode(),
        CHAT, 10,
    )  # fmt: skip
    assert bad.lines == ()
    assert [(e["line"], e["code"]) for e in bad.errors] == [
        (2, "duplicate_custom_id"), (3, "mismatched_url"), (4, "invalid_json_line"),
        (5, "invalid_value"), (6, "missing_required_parameter"),
    ]  # fmt: skip
    assert parse_input(b"", CHAT, 10).errors[0]["code"] == "empty_file"
    many = "\n".join(_line(str(i)) for i in range(11)).encode()
    assert parse_input(many, CHAT, 10).errors[0]["code"] == "too_many_requests"
    assert parse_input(b"\xff\xfe", CHAT, 10).errors[0]["code"] == "invalid_file"


def test_lines_json_loads_takes_but_are_no_json_text_fail_validation() -> None:
    """A lone surrogate failed every pass of the runner (the batch never ended), a line
    nested past the parser's limit left it validating for good, and a NaN reached the
    request: each is now an invalid line, as a body with it is a 400."""
    head = '{"custom_id": "a", "method": "POST", "url": "' + CHAT + '", "body": '
    for body, says in [
        (
            '{"model": "m", "messages": [{"role": "user", "content": "x\\ud800"}]}',
            "surrogate escape",
        ),
        ('{"model": "m", "temperature": NaN}', "NaN is not a JSON number"),
        ('{"model": "m", "messages": ' + "[" * 50_000 + "]" * 50_000 + "}", "nests too deeply"),
    ]:
        parsed = parse_input((head + body + "}").encode(), CHAT, 10)
        assert parsed.lines == ()
        (error,) = parsed.errors
        assert (error["line"], error["code"]) == (1, "invalid_json_line")
        assert says in error["message"]
    with_bom = parse_input(b"\xef\xbb\xbf" + _line("a").encode(), CHAT, 10)
    assert [ln.custom_id for ln in with_bom.lines] == ["a"] and with_bom.errors == ()


def test_multipart_upload_parts() -> None:
    boundary = boundary_of('multipart/form-data; boundary="xyz"')
    body = (b"--xyz\r\nContent-Disposition: form-data; name=\"purpose\"\r\n\r\nbatch\r\n"
            b"--xyz\r\nContent-Disposition: form-data; name=\"file\"; filename=\"in.jsonl\"\r\n"
            b"Content-Type: application/jsonl\r\n\r\n{\"a\":1}\r\n\r\n--xyz--\r\n")  # fmt: skip
    parts = parse_multipart(body, boundary)
    assert parts["purpose"].content == b"batch"
    assert (parts["file"].filename, parts["file"].content) == ("in.jsonl", b'{"a":1}\r\n')
    with pytest.raises(MultipartError):
        boundary_of("application/json")
    with pytest.raises(MultipartError):
        parse_multipart(b"no parts here", boundary)


def test_the_batch_price_factor_is_exact_and_rounds_down() -> None:
    assert discounted_pusd(2 * 10**12, Fraction(1, 2)) == 10**12
    assert discounted_pusd(3, Fraction(1, 2)) == 1
    assert discounted_pusd(7, Fraction(1)) == 7
    assert discounted_pusd(7, Fraction(0)) == 0


def test_batch_flags_carry_units_and_refuse_a_factor_past_one() -> None:
    from kvflow.router.cli import parse_args

    settings = parse_args(["--batch-dir", "/tmp/b", "--batch-price-factor", "0.25",
                           "--batch-max-file-bytes", "1024", "--batch-max-in-flight", "3",
                           "--batch-completion-window-s", "60"], env={})  # fmt: skip
    assert settings is not None
    batch = settings.batch
    assert (str(batch.batch_dir), batch.price_factor, batch.max_file_bytes) == (
        "/tmp/b", Fraction(1, 4), 1024)  # fmt: skip
    assert (batch.max_in_flight, batch.completion_window_s) == (3, 60.0)
    assert parse_args([], env={}).batch.price_factor == Fraction(1, 2)  # type: ignore[union-attr]
    for bad in ("1.5", "-0.1", "half"):
        with pytest.raises(SystemExit):
            parse_args(["--batch-price-factor", bad], env={})


def test_the_directory_store_keeps_each_lines_first_result_and_skips_torn_records(
    tmp_path: Path,
) -> None:
    store = DirBatchStore(tmp_path)
    record = _record()

    async def run() -> None:
        await store.put_batch(record)
        await store.add_result(record.id, 0, True, '{"first": 1}')
        await store.add_result(record.id, 0, False, '{"again": 1}')  # ran twice: kept once
        with (tmp_path / "results" / f"{record.id}.jsonl").open("a") as f:
            f.write('{"i": 1, "ok": tr')  # a crash mid-append
        assert await store.results(record.id) == {0: (True, '{"first": 1}')}
        assert await store.counts(record.id) == (1, 0)
        (tmp_path / "batches" / "batch-torn.json").write_text('{"id": "batch-to')
        assert await store.active_batch_ids() == [record.id]

    asyncio.run(run())
