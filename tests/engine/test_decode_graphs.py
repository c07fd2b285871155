"""Decode steps padded to the buckets of model/decode_graphs.py, and their CUDA graphs.

On a CPU nothing is captured: the padded step runs eagerly, and these tests hold it to the
engine's own decode path (the whole engine's greedy tokens against transformers are in
test_generation_parity.py and test_preemption_parity.py, mode "graphs"). The capture and
replay themselves need a CUDA GPU: the `gpu` test at the end runs them wherever one exists.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
import torch
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.app import build_worker
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.model.attention_metadata import AttentionMetadata
from kvflow.engine_worker.model.decode_graphs import (
    MAX_PADDED_TOKENS,
    DecodeGraphs,
    DecodeStep,
    bucket,
)
from kvflow.engine_worker.model.loader import load_model
from kvflow.engine_worker.runner import TorchModelRunner
from kvflow.engine_worker.settings import WorkerSettings, parse_args

BLOCK_SIZE = 4
NUM_BLOCKS = 32


@pytest.fixture(scope="module")
def tiny(tmp_path_factory: pytest.TempPathFactory) -> tuple[str, Any]:
    path = write_tiny_llama(
        tmp_path_factory.mktemp("tiny") / "model", seed=5, num_hidden_layers=2, vocab_size=4096
    )
    return str(path), load_model(path)


def graphed_runner(loaded: Any, max_batch: int = 8) -> TorchModelRunner:
    model, config = loaded
    runner = TorchModelRunner(
        model,
        num_layers=config.num_hidden_layers,
        num_kv_heads=config.num_key_value_heads,
        head_dim=config.head_dim,
        num_blocks=NUM_BLOCKS,
        block_size=BLOCK_SIZE,
        dtype=torch.float32,
        decode_graph_batch=max_batch,
    )
    gen = torch.Generator().manual_seed(0)
    for cache in runner.kv_caches:  # every block holds something, as in a busy cache
        cache.copy_(torch.randn(cache.shape, generator=gen))
    return runner


def decode_step(tables: list[list[int]], context_lens: list[int]) -> DecodeStep:
    positions = [n - 1 for n in context_lens]
    return DecodeStep(
        token_ids=[11 + 7 * i for i in range(len(tables))],
        positions=positions,
        slots=[
            t[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
            for t, p in zip(tables, positions, strict=True)
        ],
        block_tables=tables,
        context_lens=context_lens,
    )


def eager_logits(runner: TorchModelRunner, step: DecodeStep) -> torch.Tensor:
    """The same step through the engine's own path: metadata from AttentionMetadata.build."""
    meta = AttentionMetadata.build(
        query_lens=[1] * len(step.token_ids),
        context_lens=step.context_lens,
        block_tables=step.block_tables,
        block_size=BLOCK_SIZE,
    )
    ids = torch.tensor(step.token_ids)
    positions = torch.tensor(step.positions)
    model = runner.model
    return model.compute_logits(model(ids, positions, runner.kv_caches, meta))


@torch.inference_mode()
def test_a_padded_step_computes_what_the_eager_one_does_and_pads_write_only_scratch(
    tiny: tuple[str, Any],
) -> None:
    _, loaded = tiny
    runner = graphed_runner(loaded)
    assert runner.graphs is not None and not runner.graphs.capture
    assert all(c.shape[0] == NUM_BLOCKS + 1 for c in runner.kv_caches)  # the scratch block
    # Three sequences (padded to 4) over 2, 3 and 4 blocks (tables padded to 4).
    step = decode_step([[3, 7], [1, 2, 9], [4, 5, 6, 8]], [5, 9, 14])
    before = [c.clone() for c in runner.kv_caches]
    padded = runner.graphs.run(step).clone()
    after_padded = [c.clone() for c in runner.kv_caches]
    for c, b in zip(runner.kv_caches, before, strict=True):
        c.copy_(b)
    expected = eager_logits(runner, step)
    assert padded.shape == expected.shape == (3, 4096)
    torch.testing.assert_close(padded, expected, rtol=1e-5, atol=1e-5)
    assert runner.graphs.buckets == [(4, 4)]

    written = set(step.slots)
    scratch = NUM_BLOCKS * BLOCK_SIZE
    for layer, caches in enumerate(zip(before, after_padded, runner.kv_caches, strict=True)):
        b, p, e = (t.flatten(0, 1) for t in caches)  # [slots, 2, kv_heads, head_dim]
        changed = {int(s) for s in (p != b).flatten(1).any(1).nonzero().flatten()}
        assert changed == written | {scratch}, layer  # this step's slots, and the pad's
        # The same K/V where the eager step wrote them (a 4-row GEMM may round differently).
        torch.testing.assert_close(p[:scratch], e[:scratch], rtol=1e-5, atol=1e-5)


@torch.inference_mode()
def test_steps_share_a_bucket_up_to_its_power_of_two(tiny: tuple[str, Any]) -> None:
    _, loaded = tiny
    runner = graphed_runner(loaded)
    assert runner.graphs is not None
    assert [bucket(n) for n in (1, 2, 3, 4, 5, 8, 9)] == [1, 2, 4, 4, 8, 8, 16]
    for batch, blocks in ((3, 3), (4, 4), (1, 1), (5, 2), (8, 5)):
        tables = [[(i * 5 + j) % NUM_BLOCKS for j in range(blocks)] for i in range(batch)]
        step = decode_step(tables, [BLOCK_SIZE * blocks - 1] * batch)
        logits = runner.graphs.run(step)
        torch.testing.assert_close(logits, eager_logits(runner, step), rtol=1e-5, atol=1e-5)
    assert runner.graphs.buckets == [(1, 1), (4, 4), (8, 2), (8, 8)]
    assert runner.graphs.steps == 5
    assert not runner.graphs.fits(9, 1)  # past max_batch: the runner steps eagerly
    assert not runner.graphs.fits(1, NUM_BLOCKS + 1)  # past max_blocks


def test_a_step_that_would_pad_past_the_gather_bound_is_left_to_the_eager_path() -> None:
    def forward(*_: Any) -> torch.Tensor:
        raise AssertionError("not called")

    graphs = DecodeGraphs(
        forward,
        block_size=16,
        scratch_slot=0,
        max_batch=256,
        max_blocks=4096,
        device=torch.device("cpu"),
        capture=False,
    )
    assert MAX_PADDED_TOKENS == 256 * 64 * 16
    assert graphs.fits(256, 64) and graphs.fits(129, 33) and graphs.fits(16, 1024)
    assert not graphs.fits(256, 65) and not graphs.fits(17, 1024) and not graphs.fits(1, 4097)


def test_cuda_graphs_are_refused_off_a_cuda_device_with_what_to_do() -> None:
    with pytest.raises(SystemExit):
        parse_args(["--cuda-graphs"])
    with pytest.raises(SystemExit):
        parse_args(["--device", "cuda", "--cuda-graphs", "--decode-workspace-gib", "1"])
    settings = parse_args(["--device", "cuda:0", "--cuda-graphs"])
    assert settings.cuda_graphs and settings.resolved_decode_workspace_gib() == 0.0


def test_the_refusal_says_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit):
        parse_args(["--device", "cpu", "--cuda-graphs"])
    assert "--cuda-graphs needs a CUDA device (--device cuda)" in capsys.readouterr().err


def greedy_outputs(
    path: str, loaded: Any, prepare: Callable[[Any], None] | None = None, **settings: Any
) -> tuple[dict[str, list[int]], Any]:
    worker = build_worker(
        WorkerSettings(model=path, block_size=BLOCK_SIZE, num_kv_blocks=256, **settings),
        loaded=loaded,
    )
    if prepare is not None:
        prepare(worker.runner)
    engine = worker.engine
    gen = torch.Generator().manual_seed(3)
    for i in range(12):  # batches that shrink through every bucket as requests finish
        length = int(torch.randint(3, 40, (1,), generator=gen))
        prompt = torch.randint(3, 4096, (length,), generator=gen)
        params = SamplingParams(temperature=0.0, max_tokens=2 + 3 * i, ignore_eos=True)
        engine.add_request(f"r{i}", prompt.tolist(), params)
    outputs: dict[str, list[int]] = {}
    while engine.has_unfinished_requests:
        for out in engine.step():
            outputs.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
    return outputs, worker.runner


def test_a_failed_capture_turns_graphs_off_and_every_step_still_runs(
    tiny: tuple[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    path, loaded = tiny
    expected, _ = greedy_outputs(path, loaded, decode_workspace_gib=0.0)

    def capture_on_cpu(runner: Any) -> None:
        # Its first decode step records a graph, which fails for real: the cache is on
        # the CPU, and a CUDA graph's streams need a CUDA device.
        runner.graphs.capture = True

    with caplog.at_level(logging.WARNING, logger="kvflow.engine_worker.runner"):
        outputs, runner = greedy_outputs(path, loaded, capture_on_cpu, cuda_graphs=True)
    assert outputs == expected  # the step whose capture failed ran eagerly, and so did the rest
    assert runner.graphs is None
    assert "CUDA graphs off from now on" in caplog.text
    assert "capturing the 16 x 16 bucket: Expected a cuda device" in caplog.text
    assert caplog.text.count("CUDA graphs off") == 1


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not run here")
@pytest.mark.parametrize("kv", ["auto", "int8", "fp8"])
def test_replayed_graphs_decode_exactly_as_the_eager_cuda_path(tmp_path: Path, kv: str) -> None:
    """A quantized cache too: the graph records the quantizing write and the dequantizing
    gather like any other kernel."""
    path = str(write_tiny_llama(tmp_path / "model", seed=5, vocab_size=4096))
    loaded = load_model(path, device="cuda")
    eager, _ = greedy_outputs(path, loaded, device="cuda", kv_cache_dtype=kv)
    graphed, runner = greedy_outputs(
        path, loaded, device="cuda", cuda_graphs=True, kv_cache_dtype=kv
    )
    assert graphed == eager
    graphs = runner.graphs
    assert graphs.capture and graphs.captures == len(graphs.buckets) >= 4
    assert graphs.steps > graphs.captures  # most steps were replays


def count_host_syncs(fn: Callable[[], object]) -> int:
    """How many times ``fn`` made the host wait for the GPU (torch's sync debug mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchroniz" in str(w.message).lower() for w in caught)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not run here")
def test_a_replayed_decode_step_waits_for_the_gpu_once_for_its_tokens(tmp_path: Path) -> None:
    path = str(write_tiny_llama(tmp_path / "model", seed=5, vocab_size=4096))
    loaded = load_model(path, device="cuda")
    worker = build_worker(
        WorkerSettings(
            model=path, device="cuda", block_size=BLOCK_SIZE, num_kv_blocks=64, cuda_graphs=True
        ),
        loaded=loaded,
    )
    engine = worker.engine
    params = SamplingParams(temperature=0.0, max_tokens=8, ignore_eos=True)
    for i in range(3):
        engine.add_request(f"r{i}", [5 + i, 6, 7], params)
    for _ in range(3):  # the prefill, then decode steps until the bucket is captured
        engine.step()
    captured = worker.runner.graphs.captures
    assert count_host_syncs(engine.step) == 1  # the sampled tokens' copy to the host
    assert worker.runner.graphs.captures == captured  # that step replayed
