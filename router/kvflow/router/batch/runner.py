"""Runs batches' lines in spare capacity, each as a request of the batch's tenant at the
``batch`` priority class, through the gateway's own completion path (quotas, routing,
admission, accounting and pricing all apply).

At most ``max_in_flight`` lines run at once in this router. Before starting one the runner
looks at the pool's last load reports (the shared rule, batch/pacing.py): while any worker
has requests waiting, online traffic is using the capacity, and with an online TPOT target
set, while a worker's decode step with one more sequence would pass its share of that
target, online requests would decode slower: either way the runner waits. A line refused
by admission or a quota (429/503) is put back and its batch backs off (at least the
Retry-After, else doubling to 30 s): other batches, other tenants' among them, go on, so a
tenant whose daily budget is spent holds only its own batches until the budget refills.
Each finished line's result is stored at once (batch/store.py), so a restarted router
resumes a batch without running its done lines again. When the batch ends, its last record
(files, counts) is stored first and its results and cancel request dropped after: a crash
before the record is stored resumes the batch from them.
"""

from __future__ import annotations

import asyncio
import json
import logging
import secrets
import time
from dataclasses import replace
from typing import Any

from fastapi import FastAPI

from kvflow.router.api.completions import handle_completion
from kvflow.router.api.gateway import Gateway
from kvflow.router.api.respond import CLIENT_GONE
from kvflow.router.api.responses import handle_response
from kvflow.router.batch.config import BatchConfig
from kvflow.router.batch.jsonl import (
    BatchLine,
    dump_lines,
    parse_input,
    result_files,
    result_line,
)
from kvflow.router.batch.line_request import line_request
from kvflow.router.batch.pacing import WorkerLoad, may_start_line, prompt_tokens_at_most
from kvflow.router.batch.records import OUTPUT_PURPOSE, BatchRecord, FileRecord, Status
from kvflow.router.batch.running import (
    MAX_BACKOFF_S,
    InputLostError,
    Retry,
    RunningBatch,
    problem,
)
from kvflow.router.batch.store import BatchStore, with_counts
from kvflow.router.protocol.errors import ApiError
from kvflow.router.routing.cost import DEFAULT_STEP_COSTS
from kvflow.router.store_errors import STORE_ERRORS
from kvflow.router.tenants.config import ANONYMOUS, Tenant

log = logging.getLogger("kvflow.router.batch")

LEASE_S = 30.0  # a batch's lease in a shared store; renewed on every pass


# A batch whose pass fails this many times in a row for a reason other than its store is
# failed with an ``internal_error``: the same input failing the same code every pass is a
# bug, which retrying forever would hide while the batch never ends. A store's outage
# (STORE_ERRORS) is waited out: it ends.
MAX_FAILED_PASSES = 5


class BatchRunner:
    def __init__(
        self, app: FastAPI, gateway: Gateway, store: BatchStore, config: BatchConfig
    ) -> None:
        self._app = app
        self._gw = gateway
        self._store = store
        self._config = config
        self._owner = secrets.token_hex(8)
        self._running: dict[str, RunningBatch] = {}
        self._loop_task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()
        self._failed_passes: dict[str, int] = {}  # batch id -> passes failed in a row
        self._unreadable: set[str] = set()  # batch ids whose record did not parse (logged)

    def start(self) -> None:
        self._loop_task = asyncio.create_task(self._loop(), name="batch-runner")

    async def stop(self) -> None:
        """Lines in flight are abandoned, not stored: a restarted router runs them again."""
        self._stopping.set()
        tasks = [t for r in self._running.values() for t in r.in_flight.values()]
        if self._loop_task is not None:
            tasks.append(self._loop_task)
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)

    def num_in_flight(self) -> int:
        return sum(len(r.in_flight) for r in self._running.values())

    async def _loop(self) -> None:
        while True:
            try:
                await self.step()
            except asyncio.CancelledError:
                raise
            except Exception:  # a store outage: try again next pass
                log.exception("batch runner pass failed")
            await asyncio.sleep(self._config.poll_interval_s)

    async def step(self) -> None:
        """One pass over the active batches, oldest first (by creation time: ids are
        random)."""
        records: list[BatchRecord] = []
        for batch_id in await self._store.active_batch_ids():
            try:
                record = await self._store.get_batch(batch_id)
            except STORE_ERRORS:
                log.exception("batch %s: the store failed this pass; trying again", batch_id)
                continue
            except Exception:  # unreadable (another version's record?): it holds no other
                if batch_id not in self._unreadable:  # once, not every pass
                    self._unreadable.add(batch_id)
                    log.exception("batch %s: its record cannot be read; skipped", batch_id)
                continue
            if record is not None and not record.status.is_terminal:
                records.append(record)
        records.sort(key=lambda r: (r.created_at, r.id))
        for record in records:
            batch_id = record.id
            try:
                if not await self._store.claim(batch_id, self._owner, LEASE_S):
                    self._let_go(batch_id)  # another replica runs it
                    continue
                await self._advance(record)
                self._failed_passes.pop(batch_id, None)
            except STORE_ERRORS:
                log.exception("batch %s: the store failed this pass; trying again", batch_id)
            except Exception:  # one bad batch must not stop the others
                log.exception("batch %s: this pass failed", batch_id)
                try:
                    await self._failed_pass(batch_id)
                except Exception:
                    log.exception("batch %s: failing it failed too; next pass", batch_id)

    def _let_go(self, batch_id: str) -> None:
        """Forget a batch another replica now holds (this one's lease lapsed: a slow pass):
        its lines here are cancelled, and were this replica to take it again, it would read
        what is done from the store, not run its old list of pending lines twice."""
        running = self._running.pop(batch_id, None)
        if running is not None:
            for task in running.in_flight.values():
                task.cancel()
            log.warning("batch %s: another router replica holds it now; let go", batch_id)

    async def _failed_pass(self, batch_id: str) -> None:
        """Count a pass that failed for a reason other than the store; at
        MAX_FAILED_PASSES in a row, fail the batch: its lines in flight are cancelled, the
        results of those done stay stored (no output file is written: writing it may be
        what fails)."""
        num_failed = self._failed_passes[batch_id] = self._failed_passes.get(batch_id, 0) + 1
        if num_failed < MAX_FAILED_PASSES:
            return
        try:
            record = await self._store.get_batch(batch_id)
            if record is None or record.status.is_terminal:
                self._failed_passes.pop(batch_id, None)  # it ended some other way
                return
            running = self._running.pop(batch_id, None)
            if running is not None:
                for task in running.in_flight.values():
                    task.cancel()
                await asyncio.gather(*running.in_flight.values(), return_exceptions=True)
            problem = {
                "code": "internal_error",
                "param": None,
                "line": None,
                "message": f"The gateway failed on this batch {num_failed} times in a row "
                "and stopped it; its log names the cause. Submit the batch again, or report "
                "the log's error if it fails again.",
            }
            await self._end(record.moved(Status.FAILED, int(time.time()), errors=(problem,)))
            self._failed_passes.pop(batch_id, None)
            log.error("batch %s failed: %d passes failed in a row", batch_id, num_failed)
        except STORE_ERRORS:
            log.exception("batch %s: the store failed while failing it; next pass", batch_id)

    async def _advance(self, record: BatchRecord) -> None:
        try:
            await self._advance_running(record)
        except InputLostError as lost:
            # Ended, not completed: completing it with no lines would drop the results of
            # those done and say nothing of why.
            running = self._running.pop(record.id, None)
            if running is not None:
                for task in running.in_flight.values():
                    task.cancel()
            await self._end(record.moved(Status.FAILED, int(time.time()), errors=lost.problems))
            log.error("batch %s failed: its input cannot be read again: %s", record.id,
                      lost.problems)  # fmt: skip

    async def _advance_running(self, record: BatchRecord) -> None:
        now_s = int(time.time())
        cancel_at = await self._store.cancel_requested(record.id)
        if record.status in (Status.VALIDATING, Status.IN_PROGRESS) and cancel_at is not None:
            record = await self._put(record.moved(Status.CANCELLING, cancel_at))
        if record.status == Status.VALIDATING:
            await self._validate(record, now_s)
        elif record.status == Status.IN_PROGRESS:
            await self._progress(record, now_s)
        elif record.status == Status.CANCELLING:
            running = self._running.get(record.id)
            if running is None or not running.in_flight:  # the lines in flight end first
                await self._finalize(record, Status.CANCELLED, now_s)
        elif record.status == Status.FINALIZING:
            await self._finalize(record, None, now_s)

    async def _put(self, record: BatchRecord) -> BatchRecord:
        await self._store.put_batch(record)
        return record

    async def _end(self, final: BatchRecord, done: tuple[int, int] | None = None) -> None:
        """Store a batch's last record, with its counts (``done``: completed, failed; else
        the store's), then drop its lines' results and its cancel request. Only after: till
        the record is stored the batch is active, and a router that resumes it reads them."""
        if done is None:
            done = await self._store.counts(final.id)
        await self._put(replace(final, final_counts=with_counts(final, done)))
        await self._store.drop_progress(final.id)

    async def _validate(self, record: BatchRecord, now_s: int) -> None:
        content = await self._store.get_content(record.input_file_id)
        if content is None:
            missing = problem("file_not_found", "input_file_id",
                              f"The input file {record.input_file_id} was deleted.")  # fmt: skip
            await self._end(record.moved(Status.FAILED, now_s, errors=(missing,)))
            return
        # Parsing, building the result files: off the event loop, which serves the online
        # requests meanwhile (an input file is up to --batch-max-file-bytes).
        parsed = await asyncio.to_thread(parse_input, content, record.endpoint,
                                         self._config.max_lines)  # fmt: skip
        if parsed.errors:
            await self._end(record.moved(Status.FAILED, now_s, errors=parsed.errors))
            return
        self._running[record.id] = RunningBatch(parsed.lines, set(), self._config.busy_backoff_s)
        await self._put(record.moved(Status.IN_PROGRESS, now_s, total=len(parsed.lines)))

    async def _running_of(self, record: BatchRecord) -> RunningBatch:
        """This batch's lines; after a restart read again, and its stored results skipped.
        Raises InputLostError when they cannot be read again (the batch is then failed)."""
        running = self._running.get(record.id)
        if running is None:
            content = await self._store.get_content(record.input_file_id)
            if content is None:
                raise InputLostError(problem("file_not_found", "input_file_id",
                                          f"The input file {record.input_file_id} was "
                                          "deleted while the batch ran."))  # fmt: skip
            # Its line count was checked when it started: a lower --batch-max-lines since
            # then does not apply to it.
            parsed = await asyncio.to_thread(parse_input, content, record.endpoint,
                                             max(self._config.max_lines, record.total))  # fmt: skip
            if parsed.errors:
                raise InputLostError(*parsed.errors)
            done = set(await self._store.results(record.id))
            running = self._running[record.id] = RunningBatch(parsed.lines, done,
                                                          self._config.busy_backoff_s)  # fmt: skip
        return running

    async def _progress(self, record: BatchRecord, now_s: int) -> None:
        running = await self._running_of(record)
        if now_s >= record.expires_at:
            for task in running.in_flight.values():
                task.cancel()  # past its window: what has not ended is expired
            await asyncio.gather(*running.in_flight.values(), return_exceptions=True)
            await self._put(record.moved(Status.FINALIZING, now_s))
            return
        if not running.pending and not running.in_flight:
            await self._put(record.moved(Status.FINALIZING, now_s))
            return
        while running.pending and self.num_in_flight() < self._config.max_in_flight:
            if time.monotonic() < running.hold_until or self._is_stopping():
                return
            line = running.lines[running.pending[0]]
            if self._pool_is_busy(record, line):
                running.hold_until = time.monotonic() + self._config.poll_interval_s
                return
            running.pending.popleft()
            task = asyncio.create_task(self._run_line(record, running, line))
            running.in_flight[line.index] = task

    def _is_stopping(self) -> bool:
        """Stopping, or draining: a line started now would only be abandoned."""
        drain = getattr(self._app.state, "drain", None)
        return self._stopping.is_set() or (drain is not None and drain.is_draining)

    def _tenant(self, name: str) -> Tenant | None:
        tenants = self._gw.tenants.current
        if tenants.is_open:
            return ANONYMOUS
        return tenants.tenants.get(name)

    def _pool_is_busy(self, record: BatchRecord, line: BatchLine) -> bool:
        """The line's pool has no room for it (batch/pacing.py): requests wait in some
        worker's queue, or a worker's decode step with it would pass the online TPOT
        headroom. A line that cannot be routed is not held: it runs into its error."""
        tenant = self._tenant(record.tenant)
        model = line.body.get("model")
        if tenant is None or not isinstance(model, str):
            return False
        try:
            route = self._gw.route(model, tenant, None)
        except ApiError:
            return False
        book = route.backend.pool.book
        now_s = time.monotonic()
        found = book.queues(route.served_name, now_s)
        views = {v.worker_id: v for v in book.views(now_s)}
        loads = []
        for q in found.queues:
            v = views.get(q.worker_id)
            decodes, kv = (v.num_decode_seqs, v.num_kv_tokens) if v is not None else (0, 0)
            loads.append(WorkerLoad(q.num_waiting, decodes, kv))
        # The same step model the time scorer prices with (routing/cost.py).
        timing = DEFAULT_STEP_COSTS.timing
        return not may_start_line(loads, timing, prompt_tokens_at_most(line.body),
                                  self._config.tpot_headroom)  # fmt: skip

    async def _run_line(self, record: BatchRecord, running: RunningBatch, line: BatchLine) -> None:
        try:
            outcome = await self._answer(record, line)
            if isinstance(outcome, Retry):
                running.back_off(outcome.retry_after_s)
                running.pending.appendleft(line.index)
                return
            status, request_id, body = outcome
            running.backoff_s = running.base_backoff_s
            entry = result_line(line, request_id, status, body)
            text = json.dumps(entry, separators=(",", ":"))
            await self._store_result(record.id, line.index, 200 <= status < 300, text)
        finally:
            running.in_flight.pop(line.index, None)

    async def _store_result(self, batch_id: str, index: int, ok: bool, text: str) -> None:
        """Store a line's result, through a store outage: the line stays in flight (so its
        batch does not finalize without it) and its answer, computed and charged, is not
        run again. Only stopping the router abandons it (a restart runs the line again)."""
        wait_s = self._config.busy_backoff_s
        while True:
            try:
                await self._store.add_result(batch_id, index, ok, text)
                return
            except STORE_ERRORS:
                log.exception("batch %s line %d: storing its result failed; retrying in %.0f s",
                              batch_id, index, wait_s)  # fmt: skip
            await asyncio.sleep(wait_s)
            wait_s = min(MAX_BACKOFF_S, wait_s * 2)

    async def _answer(
        self, record: BatchRecord, line: BatchLine
    ) -> tuple[int, str, dict[str, Any]] | Retry:
        request_id = "batch-" + secrets.token_hex(12)
        tenant = self._tenant(record.tenant)
        if tenant is None:
            message = f"The batch's tenant '{record.tenant}' is no longer configured."
            return 401, request_id, ApiError(401, message, code="invalid_api_key").body()
        if line.body.get("stream"):
            message = "stream is not supported in a batch: each result is one response."
            return 400, request_id, ApiError(400, message, param="stream").body()
        request = line_request(self._app, record.endpoint, line.body, request_id, self._stopping)
        try:
            if record.endpoint == "/v1/responses":
                response = await handle_response(request, tenant=tenant)
            else:
                response = await handle_completion(
                    request, is_chat=record.endpoint == "/v1/chat/completions", tenant=tenant
                )
        except ApiError as exc:
            if exc.status in (429, 503):
                return Retry(exc.retry_after_s)
            return exc.status, request_id, exc.body()
        except asyncio.CancelledError:
            raise
        except Exception:
            log.exception("batch %s line %d failed", record.id, line.index)
            message = f"The gateway failed on this request (request id {request_id})."
            return 500, request_id, ApiError(500, message, type="server_error").body()
        if response.status_code in (429, 503, CLIENT_GONE):  # CLIENT_GONE: the router stops
            return Retry(None)
        return response.status_code, request_id, json.loads(bytes(response.body))

    async def _finalize(self, record: BatchRecord, end: Status | None, now_s: int) -> None:
        """The output and error files (ids fixed by the batch's, so a pass repeated after a
        restart writes the same ones), then the batch's last status."""
        running = await self._running_of(record)
        results = await self._store.results(record.id)
        stored = await self._store.get_batch(record.id)
        if stored is None or stored.status.is_terminal:
            # Ended by another replica meanwhile (this one's lease lapsed mid-pass), which
            # drops the results once it has: those read above may be none of them.
            self._running.pop(record.id, None)
            return
        outputs, errors = await asyncio.to_thread(result_files, running.lines, results,
                                                  is_cancelled=end == Status.CANCELLED)  # fmt: skip
        output_id = await self._write(record, "output", outputs, now_s)
        error_id = await self._write(record, "error", errors, now_s)
        if end is None:
            end = Status.COMPLETED if len(results) >= len(running.lines) else Status.EXPIRED
        final = record.moved(end, now_s)
        num_ok = sum(1 for is_ok, _ in results.values() if is_ok)
        self._running.pop(record.id, None)
        await self._end(replace(final, output_file_id=output_id, error_file_id=error_id),
                        (num_ok, len(results) - num_ok))  # fmt: skip
        log.info("batch %s %s: %d ok, %d errors", record.id, end, len(outputs), len(errors))

    async def _write(
        self, record: BatchRecord, kind: str, entries: list[dict[str, Any]], now_s: int
    ) -> str | None:
        if not entries:
            return None
        content = await asyncio.to_thread(dump_lines, entries)
        file_id = f"file-{record.id}-{kind}"
        name = f"{record.id}_{kind}.jsonl"
        file = FileRecord(file_id, record.tenant, name, OUTPUT_PURPOSE, len(content), now_s)
        await self._store.put_file(file, content)
        return file_id
