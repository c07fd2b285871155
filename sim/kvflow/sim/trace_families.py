"""Generated Mooncake-format traces for the routing comparison's trace families. Pure and
deterministic by seed.

One generator covers two families by its parameters:

- **conversation**: every prompt opens with one shared system prompt (``system_tokens``,
  512 by default: one Mooncake block); a new session adds fresh context up to a prompt of
  about ``first_prompt_tokens``; a follow-up turn (``followup_fraction`` of the requests)
  resends its session's previous prompt, that turn's answer and a new user message, so
  histories grow and the previous prompt is a cached prefix wherever it was served.
- **agent**: the same with ``num_preambles`` long tool preambles (each shared by every
  session of that agent) in place of the one system prompt, short answers (tool calls)
  and tool results as the turns, and short pauses between turns.

Arrivals are Poisson at ``rate_per_s``; a follow-up never comes before its previous turn
plus ``think_s`` (a user reads the answer, a tool runs), so a session's turns are spread
over the trace as recorded conversations are. Lengths are log-normal around their means
(a coefficient of variation of ``length_cv``). Block ids are Mooncake's: one id per
512-token block, equal ids equal text, a partial last block a prefix of the full one
(``bench/trace_replay.py``), so a turn that extends the previous prompt reuses its ids.
"""

from __future__ import annotations

import heapq
import json
import math
import random
from collections.abc import Iterable
from dataclasses import dataclass, replace
from pathlib import Path

from kvflow.loadgen.trace import MOONCAKE_BLOCK_TOKENS, TraceRecord


@dataclass(frozen=True)
class TraceShape:
    name: str
    num_requests: int = 1000
    rate_per_s: float = 3.0
    system_tokens: int = MOONCAKE_BLOCK_TOKENS  # shared by every request (0: none)
    num_preambles: int = 0  # > 0: agent preambles of preamble_tokens, one per session
    preamble_tokens: int = 0
    first_prompt_tokens: int = 7000  # mean prompt of a session's first turn, shared part in
    turn_tokens: int = 300  # mean new user text (or tool result) of a follow-up
    output_tokens: int = 500  # mean answer
    followup_fraction: float = 0.1  # of requests, the next turn of an open session
    think_s: float = 20.0  # a follow-up at least this long after its previous turn
    max_prompt_tokens: int = 32_000  # a session whose next prompt would be longer ends
    length_cv: float = 0.3

    def __post_init__(self) -> None:
        if self.num_requests < 1 or self.rate_per_s <= 0:
            raise ValueError(f"{self.name}: needs requests and a rate > 0")
        if not 0.0 <= self.followup_fraction < 1.0:
            raise ValueError(f"{self.name}: followup_fraction must be in [0, 1)")
        shared = self.system_tokens + self.preamble_tokens
        if self.first_prompt_tokens <= shared:
            raise ValueError(f"{self.name}: first_prompt_tokens must exceed the shared part")


# The families the comparison publishes (compare.py's workloads of the same names). Base
# rates put x1 well under the knee and x4 past it on 8 H100 x Llama-3-8B workers.
FAMILIES: dict[str, TraceShape] = {
    shape.name: shape
    for shape in (
        # The held-out trace of the report that motivated the time-based scorer: one
        # 512-token system prompt, ~7K-token prompts, ~500-token answers, little reuse.
        TraceShape("conv-7k"),
        # Growing histories: half the requests are follow-ups.
        TraceShape("conv-7k-turns", followup_fraction=0.5),
        # Shorter prompts, more of them, mostly follow-ups.
        TraceShape(
            "conv-2k-turns",
            rate_per_s=6.0,
            first_prompt_tokens=2000,
            turn_tokens=200,
            output_tokens=300,
            followup_fraction=0.6,
        ),
        # Agents: 4 tool preambles of 4K tokens, tool results as turns, short calls.
        TraceShape(
            "agent",
            rate_per_s=6.0,
            system_tokens=0,
            num_preambles=4,
            preamble_tokens=4096,
            first_prompt_tokens=5000,
            turn_tokens=600,
            output_tokens=150,
            followup_fraction=0.7,
            think_s=2.0,
        ),
    )
}


@dataclass
class _Session:
    hash_ids: list[int]
    num_prompt_tokens: int
    num_output_tokens: int
    ready_s: float


class _Ids:
    """Fresh block ids; ids below ``first`` are reserved for shared text."""

    def __init__(self, first: int) -> None:
        self._next = first

    def take(self, n: int) -> list[int]:
        out = list(range(self._next, self._next + n))
        self._next += n
        return out


def _lognormal(rng: random.Random, mean: float, cv: float) -> float:
    sigma = math.sqrt(math.log(1.0 + cv * cv))
    return rng.lognormvariate(math.log(mean) - sigma * sigma / 2.0, sigma)


def _extend(hash_ids: list[int], num_tokens: int, ids: _Ids) -> list[int]:
    """The ids of a prompt of ``num_tokens`` that continues the prompt of ``hash_ids``:
    its blocks, the partial last one grown in place (the same id: its text goes on)."""
    num_blocks = math.ceil(num_tokens / MOONCAKE_BLOCK_TOKENS)
    return hash_ids + ids.take(num_blocks - len(hash_ids))


def generate(shape: TraceShape, seed: int = 0) -> list[TraceRecord]:
    """The trace: ``shape.num_requests`` records in time order."""
    rng = random.Random(f"{shape.name}/{seed}")
    block = MOONCAKE_BLOCK_TOKENS
    system_blocks = math.ceil(shape.system_tokens / block)
    preamble_blocks = math.ceil(shape.preamble_tokens / block)
    # Shared text has the lowest ids: the system prompt, then each preamble.
    ids = _Ids(system_blocks + shape.num_preambles * preamble_blocks)
    shared_tokens = system_blocks * block + preamble_blocks * block
    open_sessions: list[tuple[float, int, _Session]] = []  # (ready_s, tie, session)
    records: list[TraceRecord] = []
    now_s = 0.0
    tie = 0
    while len(records) < shape.num_requests:
        now_s += rng.expovariate(shape.rate_per_s)
        session: _Session | None = None
        is_ready = bool(open_sessions) and open_sessions[0][0] <= now_s
        if is_ready and rng.random() < shape.followup_fraction:
            session = heapq.heappop(open_sessions)[2]
        if session is not None:
            turn = max(1, round(_lognormal(rng, shape.turn_tokens, shape.length_cv)))
            num_tokens = session.num_prompt_tokens + session.num_output_tokens + turn
            hash_ids = _extend(session.hash_ids, num_tokens, ids)
        else:
            shared: list[int] = list(range(system_blocks))
            if shape.num_preambles:
                p = rng.randrange(shape.num_preambles)
                start = system_blocks + p * preamble_blocks
                shared += list(range(start, start + preamble_blocks))
            total = _lognormal(rng, shape.first_prompt_tokens, shape.length_cv)
            num_tokens = max(shared_tokens + 1, round(total))
            hash_ids = shared + ids.take(math.ceil(num_tokens / block) - len(shared))
        num_output = max(1, round(_lognormal(rng, shape.output_tokens, shape.length_cv)))
        records.append(TraceRecord(round(now_s * 1e3, 3), num_tokens, num_output,
                                   tuple(hash_ids)))  # fmt: skip
        # The session's next turn, if it fits and this is not the trace's end.
        next_min = num_tokens + num_output + 1
        if next_min + shape.turn_tokens <= shape.max_prompt_tokens:
            ready_s = now_s + shape.think_s * (1.0 + rng.random())
            tie += 1
            session = _Session(hash_ids, num_tokens, num_output, ready_s)
            heapq.heappush(open_sessions, (ready_s, tie, session))
    return records


def family(name: str, *, num_requests: int | None = None, seed: int = 0) -> list[TraceRecord]:
    """A named family's trace (``FAMILIES``), optionally shortened."""
    if name not in FAMILIES:
        raise ValueError(f"unknown trace family {name!r}; known: {', '.join(FAMILIES)}")
    shape = FAMILIES[name]
    if num_requests is not None:
        shape = replace(shape, num_requests=num_requests)
    return generate(shape, seed)


def trace_lines(records: Iterable[TraceRecord]) -> list[str]:
    """The Mooncake JSONL lines of ``records`` (``bench.trace.parse_trace`` reads them)."""
    return [
        json.dumps({"timestamp": r.timestamp_ms, "input_length": r.input_length,
                    "output_length": r.output_length, "hash_ids": list(r.hash_ids)})
        for r in records
    ]  # fmt: skip


def write_trace(records: Iterable[TraceRecord], path: str | Path) -> None:
    Path(path).write_text("\n".join(trace_lines(records)) + "\n", encoding="utf-8")
