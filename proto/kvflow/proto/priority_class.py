"""A request's priority class, one word everywhere: the request header or body, the tenant's
ceiling, the wire, the worker's scheduler and the gateway's admission.

Three classes, as the serving guides name them: ``realtime`` (a person is waiting on every
token), ``normal`` (the default) and ``batch`` (offline work that fills spare capacity). A
class is stronger than a tenant's priority: a worker runs every runnable realtime request
before any normal one, and when its KV blocks run out it preempts a less urgent class's
running request before its own; admission sheds batch first, then normal. Within one class,
tenants share by priority as before (kvflow.proto.fairness).
"""

from __future__ import annotations

import enum

from kvflow.proto import worker_pb2 as pb

HEADER = "x-kvflow-priority-class"
"""The request header that names a class (the body's ``priority_class`` field wins over it)."""

BODY_FIELD = "priority_class"

# OpenAI's ``service_tier`` request field names tiers of the same idea; a client written for
# OpenAI gets the class its tier means.
_SERVICE_TIERS: dict[str, str] = {
    "priority": "realtime",
    "default": "normal",
    "auto": "normal",
    "flex": "batch",
}


class PriorityClass(enum.StrEnum):
    REALTIME = "realtime"
    NORMAL = "normal"
    BATCH = "batch"

    @property
    def rank(self) -> int:
        """0 for the most urgent class: sort ascending to serve in order."""
        return _RANK[self]

    @property
    def is_online(self) -> bool:
        """A person or a service waits on it (realtime, normal), as opposed to batch work,
        which fills spare capacity: the planner sizes replicas for the online classes only."""
        return self is not PriorityClass.BATCH

    def more_urgent_than(self, other: PriorityClass) -> bool:
        return self.rank < other.rank

    def capped(self, ceiling: PriorityClass) -> PriorityClass:
        """This class, or the tenant's ceiling when it asks for more urgency than allowed."""
        return ceiling if self.rank < ceiling.rank else self

    @classmethod
    def parse(cls, word: str) -> PriorityClass:
        """A class from its word, or from an OpenAI ``service_tier``; ValueError names the words."""
        key = word.strip().lower()
        key = _SERVICE_TIERS.get(key, key)
        try:
            return cls(key)
        except ValueError:
            raise ValueError(
                f"unknown priority class {word!r}: use one of {', '.join(CLASS_WORDS)} "
                f"(or an OpenAI service_tier: {', '.join(_SERVICE_TIERS)})"
            ) from None

    def to_pb(self) -> pb.PriorityClass:
        return _TO_PB[self]

    @classmethod
    def from_pb(cls, value: int) -> PriorityClass:
        """The class a request carries; unset (a router that predates classes) is normal."""
        return _FROM_PB.get(value, PriorityClass.NORMAL)


_RANK: dict[PriorityClass, int] = {
    PriorityClass.REALTIME: 0,
    PriorityClass.NORMAL: 1,
    PriorityClass.BATCH: 2,
}
_TO_PB: dict[PriorityClass, pb.PriorityClass] = {
    PriorityClass.REALTIME: pb.PRIORITY_CLASS_REALTIME,
    PriorityClass.NORMAL: pb.PRIORITY_CLASS_NORMAL,
    PriorityClass.BATCH: pb.PRIORITY_CLASS_BATCH,
}
_FROM_PB: dict[int, PriorityClass] = {int(v): k for k, v in _TO_PB.items()}

CLASS_WORDS: tuple[str, ...] = tuple(c.value for c in PriorityClass)
"""The accepted words, most urgent first, as the CLI, the CRD and errors list them."""

ONLINE_CLASSES: tuple[PriorityClass, ...] = tuple(c for c in PriorityClass if c.is_online)
"""The classes the planner scales for; the others run on the replicas the online ones need."""

SHED_ORDER: tuple[PriorityClass, ...] = tuple(sorted(PriorityClass, key=lambda c: -c.rank))
"""The order admission sheds in when the cluster is full: batch first, then normal."""
