"""bench/engine_throughput.py's prefix-caching part: the TTFT of prompts that share 97 % of
their tokens, with prefix caching off and on."""

from __future__ import annotations

import random
import statistics
import time
from typing import Any

from kvflow_arms import new_engine

from kvflow.engine_worker.core.sampling_params import SamplingParams


def ttft_prefix_caching(
    model: str | None, loaded: Any, *, vocab: int, prompt_len: int, num_prompts: int, seed: int
) -> dict[str, Any]:
    """TTFT of prompts sharing 97 % of their tokens, one at a time (no queueing)."""
    rng = random.Random(seed)
    shared_len = round(prompt_len * 0.97)
    shared = [rng.randrange(3, vocab) for _ in range(shared_len)]
    prompts = [
        shared + [rng.randrange(3, vocab) for _ in range(prompt_len - shared_len)]
        for _ in range(num_prompts)
    ]
    result: dict[str, Any] = {"prompt_len": prompt_len, "shared_len": shared_len}
    for caching in (False, True):
        engine = new_engine(
            model,
            loaded,
            enable_prefix_caching=caching,
            max_num_batched_tokens=prompt_len,
            max_model_len=4096,
        )
        ttfts = []
        for i, prompt in enumerate(prompts):
            engine.add_request(f"t{i}", prompt, SamplingParams(temperature=0.0, max_tokens=1))
            start = time.perf_counter()
            while engine.has_unfinished_requests:
                engine.step()
            ttfts.append(time.perf_counter() - start)
        # The first prompt fills the cache in both arms; the others are what caching serves.
        key = "on" if caching else "off"
        result[f"ttft_{key}_first_s"] = ttfts[0]
        result[f"ttft_{key}_median_s"] = statistics.median(ttfts[1:])
    result["ttft_speedup"] = result["ttft_off_median_s"] / result["ttft_on_median_s"]
    return result
