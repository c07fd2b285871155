"""One list of KV transports: the worker's --kv-transport, the wire enum, the CRD's
kvTransport and the worker's transport builders agree (kvflow.proto.transports)."""

from __future__ import annotations

from typing import get_args

import pytest

from kvflow.engine_worker.kv_transfer import agent
from kvflow.engine_worker.settings import parse_args as parse_worker_args
from kvflow.operator.api import v1alpha1
from kvflow.proto import worker_pb2 as pb
from kvflow.proto.transports import KV_TRANSPORT_CHOICES, KvTransport


def test_the_crd_takes_exactly_the_shared_choices() -> None:
    assert set(get_args(v1alpha1.KvTransport)) == set(KV_TRANSPORT_CHOICES)


def test_the_wire_enum_names_each_transport_and_round_trips() -> None:
    names = {n for n in pb.KvTransport.keys() if n != "KV_TRANSPORT_UNSPECIFIED"}  # noqa: SIM118
    assert names == {f"KV_TRANSPORT_{t.value.upper()}" for t in KvTransport}
    for transport in KvTransport:
        assert KvTransport.from_pb(transport.to_pb()) is transport
    assert KvTransport.from_pb(pb.KV_TRANSPORT_UNSPECIFIED) is None


def test_every_transport_has_a_builder() -> None:
    assert set(agent._FACTORIES) == set(KvTransport)


@pytest.mark.parametrize("word", KV_TRANSPORT_CHOICES)
def test_the_worker_takes_every_choice(word: str) -> None:
    settings = parse_worker_args(["--role", "prefill", "--kv-transport", word])
    assert settings.resolved_kv_transport() in {t.value for t in KvTransport}
