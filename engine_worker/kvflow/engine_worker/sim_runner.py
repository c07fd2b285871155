"""A simulated model: the real scheduler and block accounting, a timing model for compute.

It lets one CPU host dozens of workers for routing tests and policy benchmarks. Tokens are
a fixed function of the sequence so far (the same prompt always continues the same way,
so prefix caching behaves as with a real model), and a step sleeps for as long as its
timing model says (``sim/timing.py``: a linear model of prefill tokens, decoding sequences
and KV read, with coefficients from a profile, ``sim/profiles.py``).

``sleep`` is how time passes: ``time.sleep`` in a worker process (wall time), a
worker-local clock's advance in the virtual-time cluster (``kvflow.sim``), where one
process steps dozens of these over a discrete-event clock. A zero model streams instantly
(for measuring gateway overhead). Fit a profile to the real engine (``kvflow profile``)
before trusting policy results.
"""

from __future__ import annotations

import hashlib
import time
from collections.abc import Callable, Sequence
from typing import Any

from kvflow.engine_worker.core.engine import SampledToken
from kvflow.engine_worker.core.scheduler import SchedulerOutput
from kvflow.engine_worker.sim.timing import StepTimer, StepTiming, TimedSteps

__all__ = ["SimulatedRunner", "StepTimer", "StepTiming"]


class SimulatedRunner:
    def __init__(
        self,
        *,
        vocab_size: int,
        eos_token_ids: tuple[int, ...],
        timing: StepTiming | StepTimer | None = None,  # None: no step time (streams instantly)
        eos_probability: float = 1 / 128,
        sleep: Callable[[float], None] = time.sleep,
        kv_bytes_per_block: int = 1,
        block_size: int = 16,
    ) -> None:
        self.vocab_size = vocab_size
        self.eos_token_ids = eos_token_ids
        if timing is None or isinstance(timing, StepTiming):
            timing = TimedSteps(timing or StepTiming())
        self.timing: StepTimer = timing
        # Scaled to 2**32 so the draw is an integer comparison.
        self._eos_threshold = int(eos_probability * 2**32)
        self.sleep = sleep
        # PD moves this many (meaningless) bytes per block, so a simulated transfer costs
        # what a real one of that model would on the same link.
        self.kv_bytes_per_block = kv_bytes_per_block
        self.kv_layout = f"simulated/B{block_size}/{kv_bytes_per_block}"

    def next_token(self, token_ids: list[int], *, ignore_eos: bool) -> int:
        tail = ",".join(map(str, token_ids[-4:])) + f"/{len(token_ids)}"
        digest = int.from_bytes(hashlib.blake2b(tail.encode(), digest_size=8).digest(), "little")
        if self.eos_token_ids and not ignore_eos and (digest >> 32) < self._eos_threshold:
            return self.eos_token_ids[0]
        token = digest % self.vocab_size
        while token in self.eos_token_ids:
            token = (token + 1) % self.vocab_size
        return token

    def execute(self, output: SchedulerOutput) -> dict[str, SampledToken]:
        delay_s = self.timing.step_s(output)
        if delay_s > 0:
            self.sleep(delay_s)
        return {
            s.request.request_id: SampledToken(
                self.next_token(s.request.token_ids, ignore_eos=s.request.sampling.ignore_eos)
            )
            for s in output.scheduled
            if s.samples
        }

    def release(self, request_id: str) -> None:
        pass

    # -- whole blocks in and out (PD): torch only when a simulated worker transfers -------

    def empty_blocks(self, num_blocks: int) -> Any:
        import torch

        return torch.empty((num_blocks, self.kv_bytes_per_block), dtype=torch.uint8)

    def read_blocks(self, block_ids: Sequence[int]) -> Any:
        import torch

        return torch.zeros((len(block_ids), self.kv_bytes_per_block), dtype=torch.uint8)

    def write_blocks(self, block_ids: Sequence[int], data: Any) -> None:
        assert data.shape[0] == len(block_ids)
