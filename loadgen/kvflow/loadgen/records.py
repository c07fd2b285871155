"""What the load runner observed about one request: times and counts, nothing derived.

Times are seconds on the run's monotonic clock (0 = the start of the load point), so
records from one load point compare directly. Metrics (``metrics.py``) derive TTFT, TPOT
and ITL from these and nothing else, which is what lets a hand-written record test them.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass


@dataclass(frozen=True, slots=True)
class RequestRecord:
    request_id: str
    # Open loop: when the schedule said to send it; None in closed loop (no schedule).
    scheduled_s: float | None
    sent_s: float  # when the client began sending it
    end_s: float  # the stream's last byte, or the failure
    # When each chunk with output text arrived; the first is the first token.
    token_times_s: tuple[float, ...] = ()
    # usage.completion_tokens when the server reports it, else the number of text chunks.
    num_output_tokens: int = 0
    num_prompt_tokens: int | None = None
    # usage.prompt_tokens_details.cached_tokens: prompt tokens the server's cache served.
    num_cached_tokens: int | None = None
    error: str | None = None  # a kind (``http_429``, ``timeout``...); None: it succeeded
    error_detail: str = ""
    # From kvflow's ``x-kvflow-route`` answer header, when asked: the worker that served it
    # and the cached prefix blocks the router expected there.
    worker: str | None = None
    predicted_cached_blocks: int | None = None
    # And where it went relative to its prompt's best holder (kvflow.proto.prefix_outcome:
    # best_holder, passed_over, copy, no_prefix).
    prefix_outcome: str | None = None

    @property
    def is_ok(self) -> bool:
        return self.error is None

    @property
    def schedule_lag_s(self) -> float | None:
        return None if self.scheduled_s is None else self.sent_s - self.scheduled_s

    @property
    def ttft_s(self) -> float | None:
        if not self.is_ok or not self.token_times_s:
            return None
        return self.token_times_s[0] - self.sent_s

    @property
    def e2e_s(self) -> float | None:
        return self.end_s - self.sent_s if self.is_ok else None

    @property
    def tpot_s(self) -> float | None:
        """(T_last - T_first) / (O - 1), inference-perf's definition; None for O <= 1."""
        if not self.is_ok or self.num_output_tokens < 2 or not self.token_times_s:
            return None
        return (self.token_times_s[-1] - self.token_times_s[0]) / (self.num_output_tokens - 1)

    @property
    def itls_s(self) -> list[float]:
        """Gaps between consecutive text chunks (a chunk may carry several tokens)."""
        if not self.is_ok:
            return []
        times = self.token_times_s
        return [b - a for a, b in itertools.pairwise(times)]
