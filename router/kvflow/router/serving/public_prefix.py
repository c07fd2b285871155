"""Prefixes a pool declares public (a shared system prompt): their blocks are hashed without
the tenant's salt, so every tenant shares one cached copy. Pure.

Token-level matching: a prompt shares the leading full blocks it has in common with a
public prefix, which also covers a prefix whose last tokens merge differently with the
text that follows it.
"""

from __future__ import annotations

from collections.abc import Sequence


class PublicPrefixes:
    def __init__(self, prefixes_token_ids: Sequence[Sequence[int]]) -> None:
        self._prefixes = [tuple(p) for p in prefixes_token_ids if p]
        self._max_len = max((len(p) for p in self._prefixes), default=0)

    def __len__(self) -> int:
        return len(self._prefixes)

    def num_public_blocks(self, prompt_token_ids: Sequence[int], block_size: int) -> int:
        """Leading full blocks of the prompt that belong to a public prefix."""
        if not self._prefixes:
            return 0
        head = tuple(prompt_token_ids[: self._max_len])
        best = 0
        for prefix in self._prefixes:
            num_blocks = 0
            limit = min(len(prefix), len(head))
            # Block by block: tuple slices compare in C.
            while (num_blocks + 1) * block_size <= limit:
                start, end = num_blocks * block_size, (num_blocks + 1) * block_size
                if head[start:end] != prefix[start:end]:
                    break
                num_blocks += 1
            best = max(best, num_blocks)
        return best
