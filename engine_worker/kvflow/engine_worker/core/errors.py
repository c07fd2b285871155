"""Expected failures of the engine, mapped to gRPC statuses once, at the server boundary."""


class EngineError(Exception):
    """Base of the engine's expected errors."""


class InvalidRequestError(EngineError, ValueError):
    """The request cannot be served as asked (bad parameters, too long). Never retried."""


class DuplicateRequestError(InvalidRequestError):
    """A request with this id is already in flight."""


class EngineOverloadedError(EngineError):
    """The engine is draining or its queue is full; the caller may retry elsewhere."""
