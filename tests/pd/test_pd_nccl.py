"""PD over NCCL between two GPUs: the decode worker on one GPU continues from KV that the
prefill worker on another computed and sent GPU to GPU. Runs wherever two CUDA GPUs exist;
elsewhere it is skipped and reported as not run (no machine here has two GPUs)."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit import pd_client as pc
from testkit.worker_process import launch_worker


def _num_gpus() -> int:
    try:
        import torch

        return torch.cuda.device_count() if torch.cuda.is_available() else 0
    except ImportError:
        return 0


pytestmark = [
    pytest.mark.integration,
    pytest.mark.multigpu,
    pytest.mark.skipif(_num_gpus() < 2, reason="needs two CUDA GPUs (NCCL); not run here"),
]


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_nccl_disaggregated_equals_colocated(tiny_model: Path, dtype: str) -> None:
    common = ["--model", str(tiny_model), "--kv-transport", "nccl", "--dtype", dtype,
              "--num-kv-blocks", "128"]  # fmt: skip
    ref = launch_worker([*common, "--device", "cuda:0", "--role", "both"])
    pre = launch_worker([*common, "--device", "cuda:0", "--role", "prefill"])
    dec = launch_worker([*common, "--device", "cuda:1", "--role", "decode"])
    try:
        for length in (17, 200, 700):
            p = [(i * 29 + length) % 480 + 5 for i in range(length)]
            want = pc.colocated(pc.stub(ref.address), f"ref-{length}", p, 16)
            run = pc.disaggregated(
                pc.stub(dec.address), pc.stub(pre.address), f"pd-{length}", p, 16
            )
            assert run.prefill is not None, run.prefill_error
            assert run.tokens == want
            assert (
                run.final is not None and run.final.usage.remote_tokens == (length - 1) // 16 * 16
            )
        pc.wait_idle(pc.stub(dec.address))
        pc.wait_idle(pc.stub(pre.address))
    finally:
        for w in (ref, pre, dec):
            w.stop(timeout_s=10)
