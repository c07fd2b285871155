"""One worker role, one word: the CRD, `kvflow worker --role`, the wire and the router agree."""

from __future__ import annotations

from pathlib import Path
from typing import get_args

import pytest
import yaml

from kvflow.engine_worker.settings import parse_args as parse_worker_args
from kvflow.operator.api.v1alpha1_planner import WorkerRoleName
from kvflow.operator.builders.names import WorkerRole as OperatorWorkerRole
from kvflow.proto import worker_pb2 as pb
from kvflow.proto.roles import ROLE_WORDS, Role

CRD = Path(__file__).resolve().parents[2] / "crds" / "inferencepools.kvflow.io.yaml"


def test_the_crd_words_are_the_roles() -> None:
    assert get_args(WorkerRoleName) == ROLE_WORDS
    assert OperatorWorkerRole is WorkerRoleName


def test_every_role_enum_in_the_crd_lists_exactly_the_roles() -> None:
    found: list[list[str]] = []

    def walk(node: object) -> None:
        if isinstance(node, dict):
            enum = node.get("enum")
            if isinstance(enum, list) and "prefill" in enum:
                found.append(enum)
            for value in node.values():
                walk(value)
        elif isinstance(node, list):
            for value in node:
                walk(value)

    walk(yaml.safe_load(CRD.read_text()))
    assert found, "no role enum found in the CRD"
    for enum in found:
        assert [w for w in enum if w != "router"] == list(ROLE_WORDS)


def test_the_wire_enum_names_each_role_and_round_trips() -> None:
    names = {n for n in pb.Role.keys() if n != "ROLE_UNSPECIFIED"}  # noqa: SIM118
    assert names == {f"ROLE_{r.value.upper()}" for r in Role}
    for role in Role:
        assert pb.Role.Name(role.to_pb()) == f"ROLE_{role.value.upper()}"
        assert Role.from_pb(role.to_pb()) is role
    # A worker that never set its role (an older build) is treated as colocated.
    assert Role.from_pb(pb.ROLE_UNSPECIFIED) is Role.COLOCATED


@pytest.mark.parametrize("word", [*ROLE_WORDS, "both"])
def test_the_worker_takes_every_word(word: str) -> None:
    role = parse_worker_args(["--role", word]).role
    assert role is Role.parse(word)
    assert role.value == ("colocated" if word == "both" else word)


def test_the_worker_refuses_an_unknown_role_naming_the_choices(
    capsys: pytest.CaptureFixture[str],
) -> None:
    with pytest.raises(SystemExit):
        parse_worker_args(["--role", "mixed"])
    err = capsys.readouterr().err
    assert "invalid role 'mixed'" in err and "colocated, prefill, decode" in err


def test_sides() -> None:
    assert [(r.prefills, r.decodes) for r in Role] == [(True, True), (True, False), (False, True)]
