"""A batch's and a file's records, and the batch's state machine. Pure.

validating -> in_progress -> finalizing -> completed; validating -> failed (the input file
is not a batch of this endpoint); in_progress -> finalizing -> expired (its window ran out:
done lines in the output file, the rest in the error file); a cancel while validating or in
progress -> cancelling (shown until the lines in flight end) -> cancelled.
"""

from __future__ import annotations

import builtins
import enum
import json
import secrets
from dataclasses import asdict, dataclass, field, fields, replace
from typing import Any

ENDPOINTS = ("/v1/chat/completions", "/v1/completions", "/v1/responses")
COMPLETION_WINDOWS = ("24h",)
FILE_PURPOSE = "batch"
OUTPUT_PURPOSE = "batch_output"


class Status(enum.StrEnum):
    VALIDATING = "validating"
    FAILED = "failed"
    IN_PROGRESS = "in_progress"
    FINALIZING = "finalizing"
    COMPLETED = "completed"
    EXPIRED = "expired"
    CANCELLING = "cancelling"
    CANCELLED = "cancelled"

    @property
    def is_terminal(self) -> bool:
        return self in _TERMINAL


_TERMINAL = frozenset({Status.FAILED, Status.COMPLETED, Status.EXPIRED, Status.CANCELLED})
# Each status's next ones; anything else is a bug in the runner, refused loudly. Failed
# is validation's verdict, and also where the runner stops a batch whose every pass fails
# (runner.py, MAX_FAILED_PASSES), whatever its status.
_NEXT: dict[Status, frozenset[Status]] = {
    Status.VALIDATING: frozenset({Status.FAILED, Status.IN_PROGRESS, Status.CANCELLING}),
    Status.IN_PROGRESS: frozenset({Status.FINALIZING, Status.CANCELLING, Status.FAILED}),
    Status.FINALIZING: frozenset({Status.COMPLETED, Status.EXPIRED, Status.FAILED}),
    Status.CANCELLING: frozenset({Status.CANCELLED, Status.FAILED}),
}
_STAMP = {
    Status.FAILED: "failed_at",
    Status.IN_PROGRESS: "in_progress_at",
    Status.FINALIZING: "finalizing_at",
    Status.COMPLETED: "completed_at",
    Status.EXPIRED: "expired_at",
    Status.CANCELLING: "cancelling_at",
    Status.CANCELLED: "cancelled_at",
}


def new_id(prefix: str) -> str:
    return f"{prefix}-{secrets.token_hex(12)}"


@dataclass(frozen=True)
class FileRecord:
    id: str
    tenant: str
    filename: str
    purpose: str
    bytes: int
    created_at: int

    def to_openai(self) -> dict[str, Any]:
        return {"id": self.id, "object": "file", "bytes": self.bytes,
                "created_at": self.created_at, "filename": self.filename,
                "purpose": self.purpose, "status": "processed",
                "expires_at": None, "status_details": None}  # fmt: skip

    def dumps(self) -> str:
        return json.dumps(asdict(self))

    @staticmethod
    def loads(text: str | builtins.bytes) -> FileRecord:
        return FileRecord(**_known(FileRecord, json.loads(text)))


@dataclass(frozen=True)
class Counts:
    total: int = 0
    completed: int = 0
    failed: int = 0


@dataclass(frozen=True)
class BatchRecord:
    id: str
    tenant: str
    endpoint: str
    input_file_id: str
    completion_window: str
    created_at: int
    expires_at: int
    status: Status = Status.VALIDATING
    metadata: dict[str, str] | None = None
    output_file_id: str | None = None
    error_file_id: str | None = None
    # Why it failed (status failed): the input file's problems, or the runner's
    # ``internal_error``; OpenAI's errors.data entries.
    errors: tuple[dict[str, Any], ...] = ()
    total: int = 0
    # Set where the status leaves "validating" / "in_progress" and so on.
    stamps: dict[str, int] = field(default_factory=dict)
    # An ended batch's request counts, stored with its last status: its lines' results are
    # dropped from the store then (store.py, drop_progress). None while it runs, and in a
    # record ended by an older router (its results were kept: they still count it).
    final_counts: Counts | None = None

    def moved(self, status: Status, now_s: int, **changes: Any) -> BatchRecord:
        """This batch in ``status``; ValueError for a move the state machine forbids."""
        if status not in _NEXT.get(self.status, frozenset()):
            raise ValueError(f"batch {self.id}: {self.status} -> {status} is not a move")
        return replace(self, status=status, stamps={**self.stamps, _STAMP[status]: now_s},
                       **changes)  # fmt: skip

    def to_openai(self, counts: Counts) -> dict[str, Any]:
        body: dict[str, Any] = {
            "id": self.id, "object": "batch", "endpoint": self.endpoint,
            "input_file_id": self.input_file_id,
            "completion_window": self.completion_window, "status": str(self.status),
            "created_at": self.created_at, "expires_at": self.expires_at,
            "output_file_id": self.output_file_id, "error_file_id": self.error_file_id,
            "errors": {"object": "list", "data": list(self.errors)} if self.errors else None,
            "request_counts": {"total": counts.total, "completed": counts.completed,
                               "failed": counts.failed},
            "metadata": self.metadata,
        }  # fmt: skip
        for stamp in _STAMP.values():
            body[stamp] = self.stamps.get(stamp)
        return body

    def dumps(self) -> str:
        raw = asdict(self)
        raw["status"] = str(self.status)
        return json.dumps(raw)

    @staticmethod
    def loads(text: str | bytes) -> BatchRecord:
        raw = json.loads(text)
        raw["status"] = Status(raw["status"])
        raw["errors"] = tuple(raw.get("errors", ()))
        if raw.get("final_counts") is not None:
            raw["final_counts"] = Counts(**_known(Counts, raw["final_counts"]))
        return BatchRecord(**_known(BatchRecord, raw))


def _known(cls: type, raw: dict[str, Any]) -> dict[str, Any]:
    """``raw``'s fields that ``cls`` has: a record a newer router wrote (a field added
    since) still loads here during a rolling upgrade, as in the store; what a field this
    version lacks says is not needed here."""
    names = {f.name for f in fields(cls)}
    return {k: v for k, v in raw.items() if k in names}
