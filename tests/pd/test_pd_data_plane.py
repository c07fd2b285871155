"""The KV data plane between real worker processes with the pool's worker token: gloo
transfers form their groups through signed rendezvous keys, and a prefill worker with
``--kv-peer-allow`` refuses a reservation naming an endpoint outside its networks (by
name, without opening a connection) while it serves on.

Simulated workers: the real scheduler, blocks, server and transports, no model."""

from __future__ import annotations

import grpc
import pytest
from testkit import pd_client as pc
from testkit.worker_process import launch_worker

from kvflow.proto import worker_pb2 as pb

pytestmark = [pytest.mark.integration]

TOKEN = "pool-token"
PROMPT = [(i * 31) % 470 + 9 for i in range(70)]  # 64 tokens to ship: 4 blocks
SIM = ["--simulate", "--num-kv-blocks", "64"]


def test_gloo_with_a_token_and_a_prefill_worker_that_sends_only_inside_its_networks() -> None:
    env = {"KVFLOW_WORKER_TOKEN": TOKEN}
    gloo = [*SIM, "--kv-transport", "gloo"]
    workers = [
        launch_worker([*gloo, "--role", "decode"], timeout_s=60, env=env),
        launch_worker([*gloo, "--role", "prefill", "--kv-peer-allow", "127.0.0.0/8"],
                      timeout_s=60, env=env),
        launch_worker([*gloo, "--role", "prefill", "--kv-peer-allow", "10.0.0.0/8"],
                      timeout_s=60, env=env),
    ]  # fmt: skip
    try:
        decode, inside, outside = (pc.stub(w.address, TOKEN) for w in workers)
        for rid in ("a", "b"):  # the second reuses the group the first formed
            run = pc.disaggregated(decode, inside, rid, PROMPT, 4, salt=rid)
            assert run.prefill is not None, run.prefill_error
            assert run.prefill.num_sent_blocks == 4 and len(run.tokens) == 4
            assert run.final is not None and run.final.usage.remote_tokens == 64

        run = pc.disaggregated(decode, outside, "c", PROMPT, 4, salt="c", timeout_s=3.0)
        error = run.prefill_error
        assert isinstance(error, grpc.Call) and error.code() == grpc.StatusCode.ABORTED
        assert "outside --kv-peer-allow (10.0.0.0/8)" in (error.details() or "")
        # Decode computed the prompt itself at its deadline; everyone is healthy and idle.
        assert len(run.tokens) == 4 and run.final is not None
        assert run.final.usage.remote_tokens == 0
        for worker in (decode, inside, outside):
            assert worker.Health(pb.HealthRequest(), timeout=5).is_serving
            pc.wait_idle(worker)
    finally:
        for w in workers:
            w.stop(timeout_s=10)
