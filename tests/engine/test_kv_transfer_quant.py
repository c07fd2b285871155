"""A PD transfer of quantized KV blocks, between two real runners over the real transports
(TCP in place, TCP staged, gloo): a prefill runner's model fills scattered int8/fp8 blocks,
they land byte for byte in other blocks of a decode runner, values and per-row scales
alike, in a quarter of the bytes the float32 cache would ship; and the decode runner
continues from them exactly as the prefill runner would have."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from typing import Any

import pytest
import torch
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.kv_transfer.agent import KvTransferAgent, SendStats, make_transport
from kvflow.engine_worker.kv_transfer.base import SendTarget
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.kv_quant import SCALE_BYTES
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.settings import WorkerSettings
from kvflow.proto.transports import KvTransport

BS = 16
PROMPT = [(i * 37) % 4000 + 5 for i in range(75)]  # 4 full blocks and a partial one
SRC_IDS = [9, 3, 17, 4, 30]  # scattered, as after churn
DST_IDS = [21, 22, 0, 13, 7]


class Outcome:
    """A transfer's completion, set from the agent's thread."""

    def __init__(self) -> None:
        self.event = threading.Event()
        self.value: Any = "pending"

    def __call__(self, value: Any) -> None:
        self.value = value
        self.event.set()

    def wait(self) -> Any:
        assert self.event.wait(20), "no completion"
        return self.value


@pytest.fixture(scope="module")
def loaded(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = write_tiny_llama(tmp_path_factory.mktemp("kvq-pd") / "m", seed=5, head_dim=64)
    return load_model(str(path))


def runner(loaded: Any, kv: str) -> Any:
    settings = WorkerSettings(num_kv_blocks=32, kv_cache_dtype=kv, decode_workspace_gib=0.0)
    return build_worker(settings, loaded=loaded).runner


@torch.inference_mode()
def forward(r: Any, tokens: list[int], start: int, table: list[int]) -> torch.Tensor:
    """Tokens [start, len) of one sequence through ``r``'s model and cache; their logits."""
    meta = AttentionMetadata.build(
        query_lens=[len(tokens) - start], context_lens=[len(tokens)], block_tables=[table],
        block_size=BS,
    )  # fmt: skip
    ids = torch.tensor(tokens[start:])
    hidden = r.model(ids, torch.arange(start, len(tokens)), r.kv_caches, meta)
    logits: torch.Tensor = r.model.compute_logits(hidden)
    return logits


@pytest.fixture(params=["tcp", "tcp-staged", "gloo"])
def pair(request: pytest.FixtureRequest) -> Iterator[tuple[KvTransferAgent, KvTransferAgent]]:
    kind = KvTransport.GLOO if request.param == "gloo" else KvTransport.TCP
    agents = []
    for name in ("prefill-q", "decode-q"):
        transport = make_transport(
            kind, host="127.0.0.1", port=0, advertise_host="127.0.0.1", instance_id=name
        )
        if request.param == "tcp-staged":
            transport.is_in_place = False  # type: ignore[attr-defined]
        agents.append(KvTransferAgent(transport, instance_id=name, max_timeout_s=30.0))
    yield agents[0], agents[1]
    for a in agents:
        a.close()


@pytest.mark.parametrize("kv", ["int8", "fp8"])
def test_quantized_blocks_and_their_scales_land_byte_for_byte(
    pair: tuple[KvTransferAgent, KvTransferAgent], loaded: Any, kv: str
) -> None:
    sender, receiver = pair
    prefill, decode = runner(loaded, kv), runner(loaded, kv)
    assert prefill.kv_layout == decode.kv_layout and prefill.kv_layout.endswith("float16scales")
    forward(prefill, PROMPT, 0, SRC_IDS)
    received, sent = Outcome(), Outcome()
    ticket = receiver.receive("d", decode.transfer_blocks(DST_IDS), 10.0, received)
    target = SendTarget(ticket.transfer_id, ticket.endpoint, ticket.tag, "decode-q")
    sender.send("p", target, prefill.transfer_blocks(SRC_IDS), 10.0, sent)
    assert received.wait() is None
    stats = sent.wait()
    assert isinstance(stats, SendStats)

    head_dim = 64
    for src, dst in zip(prefill.kv_caches, decode.kv_caches, strict=True):
        got, want = dst[DST_IDS].view(torch.uint8), src[SRC_IDS].view(torch.uint8)
        assert torch.equal(got, want)  # every byte: values and scales
        scales = want[..., head_dim:].view(torch.float16)  # one per token, K/V and head
        assert scales.shape[-1] == 1 and SCALE_BYTES == 2
        assert scales[:, :11].gt(0).all()  # 75 tokens: the last block's first 11 are written
        assert len(scales.unique()) > 100  # each row's own scale, not one per tensor
        untouched = [b for b in range(32) if b not in DST_IDS]
        assert dst[untouched].view(torch.uint8).eq(0).all()
    # Half or less of a bf16 cache's wire bytes (64 values + a 2-byte scale per row: 0.52x
    # of bf16's, 0.26x of the float32 cache this model has).
    layers, heads = len(prefill.kv_caches), prefill.kv_caches[0].shape[3]
    assert stats.num_bytes == len(SRC_IDS) * 2 * layers * BS * heads * (head_dim + 2)
    assert stats.num_bytes / (len(SRC_IDS) * 2 * layers * BS * heads * head_dim * 2) < 0.52
    # The decode side continues from the landed blocks as the prefill side would have.
    longer = [*PROMPT, 77]
    torch.testing.assert_close(
        forward(decode, longer, 75, DST_IDS), forward(prefill, longer, 75, SRC_IDS),
        rtol=0, atol=0,
    )  # fmt: skip


def test_the_float32_cache_ships_3_9x_the_bytes(loaded: Any) -> None:
    """The same blocks of this float32 model's own cache: 4 bytes a value against 1 + 2/64."""
    f32 = runner(loaded, "auto").transfer_blocks(SRC_IDS).num_bytes
    assert f32 * 66 == runner(loaded, "int8").transfer_blocks(SRC_IDS).num_bytes * 4 * 64
