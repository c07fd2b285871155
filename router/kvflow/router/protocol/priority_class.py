"""The priority class a request asks for, and the one it gets (kvflow.proto.priority_class).

A client names a class in the body's ``priority_class``, in OpenAI's ``service_tier``
(``priority`` is realtime, ``default`` and ``auto`` normal, ``flex`` batch), or in the
``x-kvflow-priority-class`` header; the body wins over the header (it is what the client's
code wrote for this request, where a header is often a proxy's or an SDK's default), and
``priority_class`` over ``service_tier`` (kvflow's own word is the more specific). An
unknown word is a 400 that lists the accepted ones. The tenant's ceiling then caps it: a
tenant allowed ``normal`` that asks for ``realtime`` runs as ``normal`` (the response's
header says which class applied), which is not an error, so one client can ask for
realtime everywhere and get what each deployment grants.
"""

from __future__ import annotations

from collections.abc import Mapping

from kvflow.proto.priority_class import BODY_FIELD, HEADER, PriorityClass
from kvflow.router.protocol.errors import invalid_request

SERVICE_TIER_FIELD = "service_tier"


def requested_class(headers: Mapping[str, str], body: object) -> PriorityClass | None:
    """The class the request names, None when it names none; raises the 400 ApiError."""
    fields = body if isinstance(body, dict) else {}
    for name in (BODY_FIELD, SERVICE_TIER_FIELD):
        value = fields.get(name)
        if value is not None:
            return _parse(value, name, f"'{name}'")
    value = headers.get(HEADER)
    if value is not None and value.strip():
        return _parse(value, HEADER, f"the {HEADER} header")
    return None


def applied_class(requested: PriorityClass | None, ceiling: PriorityClass) -> PriorityClass:
    """The class a request runs as: what it asked for (normal when nothing), capped to the
    most urgent class its tenant may use."""
    return (requested or PriorityClass.NORMAL).capped(ceiling)


def _parse(value: object, param: str, where: str) -> PriorityClass:
    if not isinstance(value, str):
        raise invalid_request(
            f"Invalid type for {where}: expected a string, got {type(value).__name__}.",
            param=param,
        )
    try:
        return PriorityClass.parse(value)
    except ValueError as exc:
        raise invalid_request(f"Invalid value for {where}: {exc}.", param=param) from None
