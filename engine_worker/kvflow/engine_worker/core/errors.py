"""Expected failures of the engine, mapped to gRPC statuses once, at the server boundary."""


class EngineError(Exception):
    """Base of the engine's expected errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (bad parameters, too long). Never retried."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already in flight."""


class EngineOverloadedError(EngineError):
    """The engine is draining or its queue is full; the caller may retry elsewhere."""


class QueueFullError(EngineOverloadedError):
    """The waiting queue is at its bound; ``retry_after_s`` is when it should have room.

    Raised before the request holds anything (no blocks, no slot), so nothing leaks."""

    def __init__(self, message: str, *, retry_after_s: float, reason: str = "queue_full") -> None:
        super().__init__(message)
        self.retry_after_s = retry_after_s
        # Which bound refused it: "queue_full" (--max-waiting-requests) or "queue_time"
        # (--max-queue-time-s); the rejections metric's label.
        self.reason = reason


class RequestFailedError(EngineError):
    """Something broke while serving this one request (a bug, a failing logits processor):
    it was ended and its blocks freed; the worker and every other request go on."""

    def __init__(self, request_id: str, cause: BaseException) -> None:
        super().__init__(
            f"request {request_id!r} failed inside the worker ({type(cause).__name__}: "
            f"{cause}); other requests are unaffected, retrying it may succeed"
        )
        self.request_id = request_id
