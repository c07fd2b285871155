"""One priority class, one word: the header, the body, OpenAI's service_tier and the wire agree."""

from __future__ import annotations

import pytest

from kvflow.proto import worker_pb2 as pb
from kvflow.proto.priority_class import CLASS_WORDS, SHED_ORDER, PriorityClass


def test_the_wire_enum_names_each_class_and_round_trips() -> None:
    names = {n for n in pb.PriorityClass.keys() if n != "PRIORITY_CLASS_UNSPECIFIED"}  # noqa: SIM118
    assert names == {f"PRIORITY_CLASS_{c.value.upper()}" for c in PriorityClass}
    for cls in PriorityClass:
        assert PriorityClass.from_pb(cls.to_pb()) is cls
    assert PriorityClass.from_pb(pb.PRIORITY_CLASS_UNSPECIFIED) is PriorityClass.NORMAL


def test_words_are_listed_most_urgent_first_and_shed_least_urgent_first() -> None:
    assert CLASS_WORDS == ("realtime", "normal", "batch")
    assert [c.rank for c in map(PriorityClass, CLASS_WORDS)] == [0, 1, 2]
    assert SHED_ORDER == (PriorityClass.BATCH, PriorityClass.NORMAL, PriorityClass.REALTIME)
    assert PriorityClass.REALTIME.more_urgent_than(PriorityClass.NORMAL)
    assert not PriorityClass.BATCH.more_urgent_than(PriorityClass.NORMAL)


@pytest.mark.parametrize(
    ("word", "expected"),
    [("Realtime", "realtime"), (" batch ", "batch"), ("priority", "realtime"),
     ("default", "normal"), ("auto", "normal"), ("flex", "batch")],
)  # fmt: skip
def test_parse_takes_words_and_openai_service_tiers(word: str, expected: str) -> None:
    assert PriorityClass.parse(word) is PriorityClass(expected)


def test_parse_names_the_accepted_words_on_a_bad_one() -> None:
    with pytest.raises(ValueError, match="realtime, normal, batch"):
        PriorityClass.parse("urgent")


def test_a_tenant_ceiling_caps_urgency_and_never_raises_it() -> None:
    assert PriorityClass.REALTIME.capped(PriorityClass.NORMAL) is PriorityClass.NORMAL
    assert PriorityClass.BATCH.capped(PriorityClass.NORMAL) is PriorityClass.BATCH
    assert PriorityClass.REALTIME.capped(PriorityClass.REALTIME) is PriorityClass.REALTIME
