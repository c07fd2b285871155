"""The worker's refusal and the router's retry read one pushback contract (gRFC A6)."""

from __future__ import annotations

from kvflow.proto.pushback import RETRY_PUSHBACK_KEY, pushback_metadata, pushback_s


def test_what_a_worker_sends_the_router_reads_back_to_the_millisecond() -> None:
    sent = pushback_metadata(1.2346)
    assert sent == (("grpc-retry-pushback-ms", "1235"),)
    assert pushback_s(sent) == 1.235
    assert pushback_s([("other", "9"), (RETRY_PUSHBACK_KEY, b"250")]) == 0.25


def test_no_pushback_or_a_malformed_one_is_none_and_a_negative_one_is_now() -> None:
    assert pushback_s([]) is None
    assert pushback_s([(RETRY_PUSHBACK_KEY, "soon")]) is None
    assert pushback_s([(RETRY_PUSHBACK_KEY, "-5")]) == 0.0
