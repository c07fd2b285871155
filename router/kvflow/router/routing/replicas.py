"""When to copy a cached prefix to another worker: rent or buy. Pure: no I/O, no clock.

The time scorer (cost.py) values a cached prefix at the prefill it saves this request,
which is right for a prefix one request will use, and wrong for one many will: a shared
prefix (an agent's tool preamble, a group's system prompt) held by one worker draws every
request that starts with it there, and each of them pays that worker's load (its queued
prefill, its decodes) to save the prefill. The ideal router has the prefix everywhere and
pays neither. A copy on the best other worker costs one prefill of the prefix, once; not
having it costs, on every request that starts with it, the difference between its worker
and the best worker had the prefix been there too: the rent.

The rule is the rent-or-buy (ski-rental) rule: rent until the rent paid on a prefix adds
up to the price of a copy, then buy one. It never pays more than twice what the best
choice in hindsight pays, whatever the future traffic (a deterministic rule can do no
better), and it needs no guess of a prefix's popularity, nor a constant of its own: rent
and price are the scorer's seconds. A prefix one request uses (a conversation's history)
never buys a copy: its single rent is under the price, or the scorer would already have
sent the request elsewhere. A prefix whose worker keeps up pays no rent.

The ledger is keyed by the prefix's last block hash (the block hash chains every block
before it, so it names the whole prefix), bounded (``MAX_PREFIXES``, least recently paid
first out): a forgotten prefix starts renting again, which only delays a copy.
"""

from __future__ import annotations

from collections import OrderedDict

from kvflow.proto.block_hash import BlockHash

# Prefixes whose rent is remembered. A conversation's every turn adds one (its history,
# which never buys): at a few dozen requests a second, 4,096 cover minutes of traffic,
# about 100 bytes each.
MAX_PREFIXES = 4096


class ReplicaLedger:
    """The rent each prefix has paid since its last copy (seconds)."""

    def __init__(self, max_prefixes: int = MAX_PREFIXES) -> None:
        assert max_prefixes >= 1
        self._max_prefixes = max_prefixes
        self._rent_s: OrderedDict[BlockHash, float] = OrderedDict()

    def rent_s(self, prefix: BlockHash) -> float:
        return self._rent_s.get(prefix, 0.0)

    def should_copy(self, prefix: BlockHash, rent_s: float, price_s: float) -> bool:
        """This request would pay ``rent_s`` to use ``prefix`` where it is, and a copy on
        the best other worker costs ``price_s``: True to buy the copy now (the ledger
        starts over: the prefix has one more holder), False to pay the rent (recorded)."""
        if rent_s <= 0.0:
            return False
        paid_s = self._rent_s.pop(prefix, 0.0) + rent_s
        if paid_s >= price_s:
            return True
        self._rent_s[prefix] = paid_s
        if len(self._rent_s) > self._max_prefixes:
            self._rent_s.popitem(last=False)
        return False

    def __len__(self) -> int:
        return len(self._rent_s)
