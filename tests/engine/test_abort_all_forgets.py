"""After a failed step every request is aborted, and what the KV handoff kept for each (a
prefill's send target, a decode's reservation deadline) goes with it: before, each failed
step left its requests' entries behind for good."""

from __future__ import annotations

from typing import Any, cast

from testkit.fake_runner import FakeRunner

from kvflow.engine_worker import request_teardown
from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.kv_handoff import KvHandoff


def test_a_failed_steps_abort_forgets_the_handoffs_entries() -> None:
    scheduler = SchedulerConfig(
        max_num_batched_tokens=32, max_num_seqs=4, max_model_len=64, block_size=4
    )
    config = EngineConfig(
        scheduler=scheduler, num_kv_blocks=32, vocab_size=100, eos_token_ids=(3,), hash_seed=b"s"
    )
    engine = Engine(config, FakeRunner(block_size=4, vocab_size=100))
    handoff = KvHandoff.__new__(KvHandoff)  # its two maps are all abort_all touches
    handoff.remote_timeouts, handoff.send_targets = {}, {}
    for rid in ("a", "b"):
        engine.add_request(rid, [5, 6, 7], SamplingParams(max_tokens=4))
    handoff.remote_timeouts["a"] = 5.0
    handoff.send_targets["b"] = cast(Any, ("target", 5.0))
    outs = request_teardown.abort_all(engine, None, handoff)
    assert {o.request_id for o in outs} <= {"a", "b"}
    assert all(o.finish_reason is FinishReason.ABORT for o in outs)
    assert handoff.remote_timeouts == {} and handoff.send_targets == {}
    assert not engine.has_unfinished_requests
