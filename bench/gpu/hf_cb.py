"""transformers' own continuous batching as a benchmark arm (5.x: ``init_continuous_batching``).

One manager serves every batch size of a run, as one server would: created once, warmed
up once (on CUDA it captures its graphs then; timed apart), started once. Each request
asks for exactly its number of tokens: ``eos_token_id=-1`` keeps an EOS drawn from random
weights from ending it early, and the tokens that came back are counted, not assumed.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from typing import Any

# transformers' KV page: 256 tokens (its default, in both 5.17 and 5.24).
HF_PAGE_TOKENS = 256


class HfContinuousBatching:
    def __init__(
        self,
        hf: Any,
        *,
        max_new_tokens: int,
        max_requests: int,
        max_request_tokens: int,
        max_batch_tokens: int,
        is_cuda: bool,
    ) -> None:
        """A manager whose KV cache holds ``max_requests`` requests of ``max_request_tokens``
        with a quarter to spare, and whose steps take ``max_batch_tokens``, as our engine's.

        Sized explicitly, never by its default: that takes 90 % of the free memory, which on
        a CPU is 90 % of the machine's RAM (about 20 GiB allocated on a shared 24 GiB
        machine), and on the GPU would leave our engine no room for activations."""
        from transformers import GenerationConfig
        from transformers.generation.configuration_utils import ContinuousBatchingConfig

        generation = GenerationConfig(
            max_new_tokens=max_new_tokens, do_sample=False, eos_token_id=-1, pad_token_id=0
        )
        pages_per_request = -(-max_request_tokens // HF_PAGE_TOKENS)
        cb_config = ContinuousBatchingConfig(
            num_blocks=max_requests * pages_per_request * 5 // 4 + 1,
            max_batch_tokens=max_batch_tokens,
            max_requests_per_batch=max_requests,
        )
        self.manager = hf.init_continuous_batching(
            generation_config=generation, continuous_batching_config=cb_config
        )
        self.warmup_s = 0.0
        if is_cuda and hasattr(self.manager, "warmup"):
            started = time.perf_counter()
            self.manager.warmup()
            self.warmup_s = time.perf_counter() - started
        self.manager.start()
        self._runs = 0

    def run(
        self, prompts: Sequence[list[int]], output_lens: Sequence[int], timeout_s: float
    ) -> tuple[float, int]:
        """Submit every prompt at once; (wall seconds, output tokens) once all are done."""
        self._runs += 1
        ids = [f"hf{self._runs}-{i}" for i in range(len(prompts))]
        start = time.perf_counter()
        for rid, prompt, n in zip(ids, prompts, output_lens, strict=True):
            self.manager.add_request(
                list(prompt), request_id=rid, max_new_tokens=n, eos_token_id=-1
            )
        pending = set(ids)
        produced = 0
        deadline = time.monotonic() + timeout_s
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(
                    f"transformers finished {len(ids) - len(pending)} of "
                    f"{len(ids)} requests in {timeout_s:.0f} s"
                )
            result = self.manager.get_result(timeout=1.0)
            if result is None:
                if not self.manager.is_running():
                    raise RuntimeError("transformers' batching thread stopped")
                continue
            if result.request_id not in pending or not result.is_finished():
                continue
            if result.error:
                raise RuntimeError(f"transformers request {result.request_id}: {result.error}")
            pending.discard(result.request_id)
            produced += len(result.generated_tokens)
        return time.perf_counter() - start, produced

    def close(self) -> None:
        self.manager.stop(block=True, timeout=10)
