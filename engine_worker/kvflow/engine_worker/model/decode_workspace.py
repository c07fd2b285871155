"""Dense copies of the decoding sequences' K/V, kept across steps, so decode reads no gather.

Paged decode attention on the CPU gathers every sequence's blocks into a contiguous K/V
each step (``paged_cache.gather_kv``): the whole context is copied once per step per layer to
add one token to it. On tiny at a batch of 60 that copy was 29 % of a decode step. This
module keeps, for each decoding sequence, a *slot*: a row of a dense per-layer tensor
``[slots, num_kv_heads, capacity_tokens, head_dim]`` holding its context. A sequence's
slot is filled from the paged cache once, when it starts decoding (or after anything that
makes the copy stale), and after that each step appends its one new token, so a decode
step's attention is one SDPA over the slots, reading each token's K/V once and copying
nothing.

Slots are attended in up to ``MAX_GROUPS`` contiguous runs, each padded only to its own
longest context, not all to the step's longest: padding to the longest slot read 1.56x the
tokens the contexts held on a ragged batch of 64. Runs of similar lengths need slots in
order of length, and since every decoding sequence grows one token a step, an order once
made holds; arrivals into freed slots break it, so when the runs of the current layout pad
more than ``SORT_GAIN`` times what the sorted layout would, the plan permutes the slots into
order (one copy of every held slot, per layer).

The paged cache stays the truth (prefix caching, KV transfer, preemption all see only it);
a slot is a derived copy, so getting one wrong is caught by checking its length against
the context before use and refilling when they differ. The copy costs memory: at most
``max_bytes``; when a step would need more, it is served by the gather path instead and
the slots are dropped. ``plan`` is the only place that decides; ``attention`` only follows
the plan.
"""

from __future__ import annotations

import math
import mmap
from dataclasses import dataclass

import torch

# Capacity in tokens is a multiple of this; in slots, of CAPACITY_STEP_SLOTS. Growing
# copies every slot of every layer, so capacity is sized for where the decodes will end
# (``Decode.final_len``) and slots double: a batch reallocates a handful of times, not
# once per block of growth. A capacity far above the contexts costs too: SDPA over
# 300-token slots strided 1,024 apart ran at 1.4x the time of a tight layout.
CAPACITY_STEP_TOKENS = 128
CAPACITY_STEP_SLOTS = 16
# SDPA attends every slot below the highest one in use, the unused ones too (a mask does
# not make the CPU kernel skip them). When sequences finish and leave more holes than
# this, the highest slots move down into the holes: at the tail of a batch 10 sequences
# in slots up to 63 made a step 1.4x slower than the gather path.
COMPACT_SLACK_SLOTS = 8
# A step with fewer decodes gathers instead: a lone sequence on consecutive blocks is read
# in place with no copy, and the workspace's appends (two scatters per layer) are then pure
# cost: SmolLM2 at batch 1 decoded 56 % of the bandwidth ceiling with the workspace
# against 64 % without (bench/engine_roofline.py --quick, one run each).
MIN_DECODES = 2
# At most this many runs of slots are attended apart, each at least MIN_GROUP_SLOTS slots:
# every run is one more SDPA call per layer (tens of us), worth it only when it cuts the
# padding of several slots.
MAX_GROUPS = 4
MIN_GROUP_SLOTS = 8
# Re-sort the slots by length when the current layout's runs attend this many times the
# tokens the sorted layout's would: a sort copies every held slot once, so it is kept for
# layouts that arrivals have disordered, not redone for every small gain.
SORT_GAIN = 1.2


@dataclass(frozen=True)
class SlotFill:
    """Copy the first ``num_tokens`` tokens of ``block_ids`` from the paged cache into ``slot``."""

    slot: int
    block_ids: torch.Tensor  # [ceil(num_tokens / block_size)] int64
    num_tokens: int


@dataclass(frozen=True)
class SlotMove:
    """Move the first ``num_tokens`` tokens of slot ``src`` to the free slot ``dst``."""

    src: int
    dst: int
    num_tokens: int


@dataclass(frozen=True)
class SlotGroup:
    """Slots ``start..stop-1`` attended together, over their first ``num_tokens`` tokens."""

    start: int
    stop: int
    num_tokens: int  # the longest context among them
    # [stop - start, 1, 1, num_tokens], 0 where a token is and -inf past it (additive: SDPA
    # converts a bool mask in every layer, 1.1-1.5x the time of the attention itself);
    # None: nothing padded.
    mask: torch.Tensor | None


@dataclass(frozen=True)
class WorkspaceStep:
    """This step's decodes as the attention reads them: row ``rows[i]`` of the batch is the
    sequence in slot ``slots[i]``; its new token goes to position ``positions[i]``."""

    rows: torch.Tensor | None  # [B] int64: rows of the flattened batch; None: all, in order
    slots: torch.Tensor  # [B] int64
    positions: torch.Tensor  # [B] int64: context length - 1, where the new K/V goes
    num_slots: int  # slots 0..num_slots-1 are attended (unused ones are masked to one token)
    num_tokens: int  # the longest context
    groups: tuple[SlotGroup, ...]  # slots 0..num_slots-1 in runs, each padded to its own
    identity: bool  # slots == rows == 0..B-1 and num_slots == B: no permutation of q
    moves: tuple[SlotMove, ...]  # done first, in order
    fills: tuple[SlotFill, ...]
    # Done after the fills, before the appends: slot i takes what slot permutation[i] held
    # (its first ``permute_tokens`` tokens); ``fills`` name slots as they were before it.
    permutation: torch.Tensor | None
    permute_tokens: int
    # One (keys, values) pair per layer, each [capacity_slots, Hkv, capacity_tokens, D].
    layers: tuple[tuple[torch.Tensor, torch.Tensor], ...]


@dataclass(frozen=True)
class Decode:
    """One sequence decoding one token this step."""

    request_id: str
    row: int  # its row in the flattened batch
    context_len: int  # tokens it attends to, the new one included
    block_ids: list[int]
    final_len: int = 0  # the context it may reach (prompt + max_tokens): capacity to reserve


class DecodeWorkspace:
    """The slots, their per-layer tensors and which sequence holds which slot."""

    def __init__(
        self,
        *,
        num_layers: int,
        num_kv_heads: int,
        head_dim: int,
        block_size: int,
        dtype: torch.dtype,
        device: torch.device,
        max_bytes: int,
    ) -> None:
        self.num_layers = num_layers
        self.num_kv_heads = num_kv_heads
        self.head_dim = head_dim
        self.block_size = block_size
        self.dtype = dtype
        self.device = device
        self.max_bytes = max_bytes
        element = torch.tensor([], dtype=dtype).element_size()
        # keys and values of one token of one slot, in every layer
        self.bytes_per_slot_token = 2 * num_layers * num_kv_heads * head_dim * element
        self._slot_of: dict[str, int] = {}
        self._filled: list[int] = []  # tokens valid in each slot; -1: free
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._capacity_slots = 0
        self._capacity_tokens = 0

    @property
    def num_bytes(self) -> int:
        return self._capacity_slots * self._capacity_tokens * self.bytes_per_slot_token

    def release(self, request_id: str) -> None:
        """The sequence finished or was preempted: its slot is free (and stale)."""
        slot = self._slot_of.pop(request_id, None)
        if slot is not None:
            self._filled[slot] = -1

    def reset(self) -> None:
        """Drop every slot and the memory behind them."""
        self._slot_of.clear()
        self._filled = []
        self._layers = []
        self._capacity_slots = self._capacity_tokens = 0

    def plan(self, decodes: list[Decode], *, all_rows: bool) -> WorkspaceStep | None:
        """Slots for this step's decodes, the fills they need, and the tensors to read.

        ``all_rows``: the decodes are every row of the batch, in order. None when there
        are fewer than MIN_DECODES, or when the slots would take more than ``max_bytes``:
        the step then gathers as before (over the budget, the slots are dropped, and
        refilled from the paged cache once they fit again).
        """
        if len(decodes) < MIN_DECODES:
            return None  # the slots stay; a copy that falls behind is refilled later
        for d in decodes:
            self._slot_for(d.request_id)
        moves = self._compact()
        slots = [self._slot_of[d.request_id] for d in decodes]
        num_slots = max(slots) + 1
        longest = max(d.context_len for d in decodes)
        reach = max(longest, *(d.final_len for d in decodes))
        capacity = (self._capacity_slots, self._capacity_tokens)
        if not self._ensure_capacity(num_slots, longest, reach, moves):
            self.reset()
            return None
        grew = capacity != (self._capacity_slots, self._capacity_tokens)
        fills: list[SlotFill] = []
        for d, slot in zip(decodes, slots, strict=True):
            cached = d.context_len - 1  # already in the paged cache; the new token is not
            if self._filled[slot] != cached:
                num_blocks = -(-cached // self.block_size)
                if cached > 0:
                    ids = torch.tensor(d.block_ids[:num_blocks], dtype=torch.int64)
                    fills.append(SlotFill(slot, ids.to(self.device), cached))
            self._filled[slot] = d.context_len
        # A grow or a compaction this step has already planned copies; the sort waits.
        permutation, permute_tokens = None, 0
        if not grew and not moves:
            order = self._sort_order()
            if order is not None:
                permutation = torch.tensor(order, dtype=torch.int64, device=self.device)
                permute_tokens = max(self._filled)  # now in the new order
                slots = [self._slot_of[d.request_id] for d in decodes]
                num_slots = max(slots) + 1
        groups = tuple(
            self._group(start, stop, lens)
            for start, stop, lens in _runs(self._attended_lens(decodes, slots, num_slots))
        )
        identity = all_rows and slots == list(range(len(decodes))) and num_slots == len(decodes)
        rows = None
        if not all_rows:
            rows = torch.tensor([d.row for d in decodes], dtype=torch.int64, device=self.device)
        return WorkspaceStep(
            rows=rows,
            slots=torch.tensor(slots, dtype=torch.int64, device=self.device),
            positions=torch.tensor(
                [d.context_len - 1 for d in decodes], dtype=torch.int64, device=self.device
            ),
            num_slots=num_slots,
            num_tokens=longest,
            groups=groups,
            identity=identity,
            moves=moves,
            fills=tuple(fills),
            permutation=permutation,
            permute_tokens=permute_tokens,
            layers=tuple(self._layers),
        )

    def _attended_lens(self, decodes: list[Decode], slots: list[int], num_slots: int) -> list[int]:
        """Tokens each slot 0..num_slots-1 attends this step."""
        lens = [1] * num_slots  # an unused slot attends to one (stale) token: no NaN rows
        for d, slot in zip(decodes, slots, strict=True):
            lens[slot] = d.context_len
        return lens

    def _group(self, start: int, stop: int, lens: list[int]) -> SlotGroup:
        longest = max(lens)
        mask = None
        if min(lens) != longest:
            positions = torch.arange(longest)
            padded = (positions[None, :] >= torch.tensor(lens)[:, None])[:, None, None, :]
            mask = torch.zeros(padded.shape, dtype=self.dtype).masked_fill_(padded, -torch.inf)
            mask = mask.to(self.device)
        return SlotGroup(start, stop, longest, mask)

    def _sort_order(self) -> list[int] | None:
        """The held slots in order of length, when attending them so would pad less than the
        current layout by SORT_GAIN; the bookkeeping then follows that order (slot i holds
        what slot order[i] held). None: the layout stays."""
        held = sorted(self._slot_of.values())
        if len(held) < 2 * MIN_GROUP_SLOTS:
            return None  # one run whatever the order
        current = [max(n, 1) for n in self._filled[: held[-1] + 1]]
        order = sorted(held, key=lambda slot: self._filled[slot])
        ordered = [self._filled[slot] for slot in order]
        if _padded_tokens(current) <= SORT_GAIN * _padded_tokens(ordered):
            return None
        new_slot = {old: new for new, old in enumerate(order)}
        for request_id, slot in self._slot_of.items():
            self._slot_of[request_id] = new_slot[slot]
        self._filled = ordered
        return order

    def _slot_for(self, request_id: str) -> int:
        slot = self._slot_of.get(request_id)
        if slot is None:
            # The lowest free slot keeps the attended range 0..num_slots-1 dense.
            slot = next((i for i, n in enumerate(self._filled) if n < 0), len(self._filled))
            if slot == len(self._filled):
                self._filled.append(0)
            self._filled[slot] = 0  # taken, holding no token yet
            self._slot_of[request_id] = slot
        return slot

    def _compact(self) -> tuple[SlotMove, ...]:
        """Move the slots above the number in use into the holes below it, when the holes
        are more than COMPACT_SLACK_SLOTS."""
        in_use = len(self._slot_of)
        if not self._slot_of or max(self._slot_of.values()) < in_use + COMPACT_SLACK_SLOTS:
            return ()
        holes = (i for i in range(in_use) if self._filled[i] < 0)
        moves = []
        for request_id, src in sorted(self._slot_of.items(), key=lambda kv: kv[1]):
            if src < in_use:
                continue
            dst = next(holes)  # as many holes below in_use as slots in use above it
            moves.append(SlotMove(src, dst, self._filled[src]))
            self._filled[dst], self._filled[src] = self._filled[src], -1
            self._slot_of[request_id] = dst
        del self._filled[in_use:]  # every slot from here on is free
        return tuple(m for m in moves if m.num_tokens > 0)

    def _ensure_capacity(
        self, num_slots: int, num_tokens: int, reach_tokens: int, moves: tuple[SlotMove, ...]
    ) -> bool:
        """Room for ``num_slots`` slots of ``num_tokens``; when growing, twice the slots and
        up to ``reach_tokens`` as far as the budget allows."""
        if num_slots <= self._capacity_slots and num_tokens <= self._capacity_tokens:
            return True
        per_slot_token = self.bytes_per_slot_token
        tokens = _round_up(max(num_tokens, self._capacity_tokens), CAPACITY_STEP_TOKENS)
        slots = _round_up(max(num_slots, 2 * self._capacity_slots), CAPACITY_STEP_SLOTS)
        if slots * tokens * per_slot_token > self.max_bytes:
            slots = _round_up(max(num_slots, self._capacity_slots), CAPACITY_STEP_SLOTS)
        if slots * tokens * per_slot_token > self.max_bytes:
            return False
        fit = self.max_bytes // (slots * per_slot_token) // CAPACITY_STEP_TOKENS
        reach = min(_round_up(reach_tokens, CAPACITY_STEP_TOKENS), fit * CAPACITY_STEP_TOKENS)
        self._grow(slots, max(tokens, reach), moves)
        return True

    def _grow(self, num_slots: int, num_tokens: int, moves: tuple[SlotMove, ...]) -> None:
        shape = (num_slots, self.num_kv_heads, num_tokens, self.head_dim)
        old = self._layers
        self._layers = []
        for _ in range(self.num_layers):
            self._layers.append(
                (
                    _lazy_zeros(shape, self.dtype, self.device),
                    _lazy_zeros(shape, self.dtype, self.device),
                )
            )
        if old:
            for slot, held in self._held(moves).items():
                for (k, v), (ok, ov) in zip(self._layers, old, strict=True):
                    k[slot, :, :held].copy_(ok[slot, :, :held])
                    v[slot, :, :held].copy_(ov[slot, :, :held])
        self._capacity_slots, self._capacity_tokens = num_slots, num_tokens

    def _held(self, moves: tuple[SlotMove, ...]) -> dict[int, int]:
        """What a grow must copy, slot by slot: the tokens each slot holds, nothing past
        them (a step's fills and appends rewrite from a slot's own count), and not every slot
        to the longest's count: the copy writes fresh pages, and one context of 2,000 tokens
        among 63 of 10 would make a grow write 250 MiB, not 4.5. A compaction planned this
        step has already moved the counts, but not the data: its sources hold what it moves,
        its destinations nothing yet."""
        held = {slot: n for slot, n in enumerate(self._filled) if n > 0}
        for m in moves:
            held.pop(m.dst, None)
        for m in moves:
            held[m.src] = m.num_tokens
        return {slot: min(n, self._capacity_tokens) for slot, n in held.items()}


def _runs(lens: list[int]) -> list[tuple[int, int, list[int]]]:
    """Slots cut into up to MAX_GROUPS runs of equal size (at least MIN_GROUP_SLOTS each):
    ``(start, stop, their lens)``."""
    size = max(-(-len(lens) // MAX_GROUPS), MIN_GROUP_SLOTS)
    return [(a, min(a + size, len(lens)), lens[a : a + size]) for a in range(0, len(lens), size)]


def _padded_tokens(lens: list[int]) -> int:
    """Tokens attended when slots of these lengths are read in ``_runs``."""
    return sum((stop - start) * max(run) for start, stop, run in _runs(lens))


def _lazy_zeros(shape: tuple[int, ...], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """Zeros, and on the CPU zeros that cost nothing until touched.

    Zeros, not ``empty``: SDPA multiplies every attended token's V by its probability, and a
    masked token's 0 times a stale NaN is NaN, so what lies past a slot's context must be
    finite. ``torch.zeros`` writes every byte up front, and a fresh page costs a fault
    when it is first written: on the 56 M-parameter model of bench/engine_throughput.py,
    growing to 64 slots of 512 tokens wrote 1 GiB at once, and the three grows of one run
    of its workload took 7 s of about 20 (a VM where a fault cost about 18 us). A private
    anonymous mapping is zero by the kernel's contract and backed page by page as the
    slots reach into it, so a grow costs what it copies. (The paged cache stays
    ``torch.zeros``: its size is the promise ``kv_cache_gib`` makes, and an allocation it
    cannot keep should fail at start.)
    """
    if device.type != "cpu" or not hasattr(mmap, "MAP_ANONYMOUS"):
        return torch.zeros(shape, dtype=dtype, device=device)
    num_bytes = math.prod(shape) * torch.empty((), dtype=dtype).element_size()
    if num_bytes == 0:
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, num_bytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # The tensor holds the mapping (the buffer protocol); it is unmapped with the tensor.
    return torch.frombuffer(mapping, dtype=dtype).view(shape)


def _round_up(n: int, step: int) -> int:
    return -(-n // step) * step
