"""The transformers arms of bench/engine_throughput.py: its continuous batching, one static
padded batch, and one request at a time, on a workload of ``throughput_stats.py``."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from gpu.hf_cb import HfContinuousBatching
from throughput_stats import Workload

# Our engine's step budget, which transformers' manager gets too.
MAX_BATCHED_TOKENS = 512


def new_hf_cb(hf: Any, w: Workload) -> HfContinuousBatching:
    """A manager sized to the workload (every request at once, a quarter to spare), with
    our engine's step budget and batch size; warmed up on two short requests."""
    cb = HfContinuousBatching(
        hf,
        max_new_tokens=max(w.output_lens),
        max_requests=len(w.prompts),
        max_request_tokens=w.max_request_tokens,
        max_batch_tokens=MAX_BATCHED_TOKENS,
        is_cuda=False,
    )
    # Prompts of their own: the manager's prefix cache must not serve the timed ones.
    cb.run([[5] * 16, [7] * 24], [4, 4], timeout_s=120)
    return cb


def run_hf_cb(hf: Any, w: Workload) -> tuple[float, int]:
    # A fresh manager per run, as our engine: its prefix cache (on by default) would
    # otherwise serve a later run's repeat of the same prompts.
    cb = new_hf_cb(hf, w)
    try:
        wall, produced = cb.run(w.prompts, w.output_lens, timeout_s=900)
    finally:
        cb.close()
    assert produced == w.num_output_tokens, (produced, w.num_output_tokens)
    return wall, produced


def run_hf_serial(hf: Any, w: Workload, progress: Callable[[int], None]) -> tuple[float, int]:
    start = time.perf_counter()
    for i, (prompt, n) in enumerate(zip(w.prompts, w.output_lens, strict=True)):
        ids = torch.tensor([prompt])
        out = hf.generate(
            ids,
            attention_mask=torch.ones_like(ids),
            max_new_tokens=n,
            min_new_tokens=n,
            do_sample=False,
            pad_token_id=0,
        )
        assert out.shape[1] == len(prompt) + n
        progress(i)
    return time.perf_counter() - start, w.num_output_tokens


def run_hf_static(hf: Any, w: Workload) -> tuple[float, int]:
    longest = max(len(p) for p in w.prompts)
    ids = torch.zeros(len(w.prompts), longest, dtype=torch.int64)
    mask = torch.zeros_like(ids)
    for i, p in enumerate(w.prompts):  # left padding, as decoder-only batching needs
        ids[i, longest - len(p) :] = torch.tensor(p)
        mask[i, longest - len(p) :] = 1
    n = max(w.output_lens)
    start = time.perf_counter()
    out = hf.generate(
        ids,
        attention_mask=mask,
        max_new_tokens=n,
        min_new_tokens=n,
        do_sample=False,
        pad_token_id=0,
    )
    wall = time.perf_counter() - start
    assert out.shape[1] == longest + n
    return wall, w.num_output_tokens
