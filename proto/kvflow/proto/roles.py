"""The worker's role, one word everywhere: the CRD, ``kvflow worker --role``, the wire, the router.

A colocated worker prefills and decodes; a prefill worker computes prompts and ships their KV;
a decode worker receives KV and generates. The proto enum carries the same three values.
"""

from __future__ import annotations

import enum

from kvflow.proto import worker_pb2 as pb

# The spelling the worker's --role took before the word was shared; still accepted on the
# command line so existing scripts keep working.
_LEGACY_WORDS = {"both": "colocated"}


class Role(enum.StrEnum):
    COLOCATED = "colocated"
    PREFILL = "prefill"
    DECODE = "decode"

    @classmethod
    def parse(cls, word: str) -> Role:
        """A role from its word (``both`` is the old spelling of ``colocated``)."""
        return cls(_LEGACY_WORDS.get(word, word))

    @property
    def prefills(self) -> bool:
        """Whether this role computes prompts (its own, or for a decode peer)."""
        return self is not Role.DECODE

    @property
    def decodes(self) -> bool:
        """Whether this role generates tokens for callers."""
        return self is not Role.PREFILL

    def to_pb(self) -> pb.Role:
        return _TO_PB[self]

    @classmethod
    def from_pb(cls, value: int) -> Role:
        """The role a worker announces; an unset role (an old worker) is colocated."""
        return _FROM_PB.get(value, Role.COLOCATED)


_TO_PB: dict[Role, pb.Role] = {
    Role.COLOCATED: pb.ROLE_COLOCATED,
    Role.PREFILL: pb.ROLE_PREFILL,
    Role.DECODE: pb.ROLE_DECODE,
}
_FROM_PB: dict[int, Role] = {int(v): k for k, v in _TO_PB.items()}

ROLE_WORDS: tuple[str, ...] = tuple(r.value for r in Role)
"""The accepted words, in the order the CLI and the CRD list them."""
