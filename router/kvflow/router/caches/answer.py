"""A stored answer: the item stream a request produced (after tool-call extraction), kept
as it came, so a replay goes through the same response builders and streams in the same
shape as a live answer (a role chunk, the content chunks, the finish chunk, usage).

Pure: encoding, decoding, and the checks of what may be stored.
"""

from __future__ import annotations

import json
from collections.abc import AsyncGenerator, Sequence
from dataclasses import dataclass, replace

from kvflow.router.protocol.responses import ChoiceDelta, ToolCallDelta, UsageCounts
from kvflow.router.serving.types import ChoiceUsage

Item = ChoiceDelta | ChoiceUsage
# Finish reasons of an answer the model would give again; anything else (an abort, an
# error) is never stored.
STORABLE_FINISH_REASONS = frozenset({"stop", "length", "tool_calls"})
_FORMAT = 1


@dataclass(frozen=True)
class CachedAnswer:
    items: tuple[Item, ...]

    @property
    def prompt_tokens(self) -> int:
        """Counted once per prompt, as the usage of a live answer counts them."""
        seen: dict[int, int] = {}
        for item in self.items:
            if isinstance(item, ChoiceUsage):
                seen[item.prompt_index] = max(
                    seen.get(item.prompt_index, 0), item.usage.prompt_tokens
                )
        return sum(seen.values())

    def replayed(self) -> list[Item]:
        """The items as a hit streams them: every prompt token counts as cached."""
        return [
            replace(item, usage=replace(item.usage, cached_tokens=item.usage.prompt_tokens))
            if isinstance(item, ChoiceUsage)
            else item
            for item in self.items
        ]


def storable(items: Sequence[Item], num_choices: int) -> CachedAnswer | None:
    """The answer, if every choice finished normally and reported its usage; else None
    (an error, an abort, a stream cut short)."""
    reasons = {
        i.index: i.finish_reason
        for i in items
        if isinstance(i, ChoiceDelta) and i.finish_reason is not None
    }
    usages = {i.index for i in items if isinstance(i, ChoiceUsage)}
    everyone = set(range(num_choices))
    if set(reasons) != everyone or usages != everyone:
        return None
    if not set(reasons.values()) <= STORABLE_FINISH_REASONS:
        return None
    return CachedAnswer(tuple(items))


async def replay(answer: CachedAnswer) -> AsyncGenerator[Item]:
    for item in answer.replayed():
        yield item


def encode(answer: CachedAnswer) -> bytes:
    rows: list[list[object]] = []
    for item in answer.items:
        if isinstance(item, ChoiceDelta):
            assert not item.logprobs, "answers with logprobs are not cached (caches/policy.py)"
            calls = [[c.index, c.id, c.name, c.arguments] for c in item.tool_calls]
            rows.append(
                [
                    "d",
                    item.index,
                    item.text,
                    item.finish_reason,
                    item.num_prompt_tokens,
                    item.num_completion_tokens,
                    calls,
                ]
            )
        else:
            u = item.usage
            rows.append(
                [
                    "u",
                    item.index,
                    item.prompt_index,
                    u.prompt_tokens,
                    u.completion_tokens,
                    u.cached_tokens,
                ]
            )
    return json.dumps([_FORMAT, rows], separators=(",", ":"), ensure_ascii=False).encode()


def decode(data: bytes) -> CachedAnswer | None:
    """None for data this version cannot read (written by another release): a miss."""
    try:
        version, rows = json.loads(data)
        if version != _FORMAT:
            return None
        return CachedAnswer(tuple(_item(row) for row in rows))
    except (ValueError, TypeError, KeyError):
        return None


def _item(row: list[object]) -> Item:
    kind, *fields = row
    if kind == "d":
        index, text, reason, num_prompt, num_completion, calls = fields
        assert isinstance(calls, list)
        return ChoiceDelta(
            index=_int(index),
            text=str(text),
            finish_reason=None if reason is None else str(reason),
            num_prompt_tokens=_int(num_prompt),
            num_completion_tokens=_int(num_completion),
            tool_calls=tuple(ToolCallDelta(_int(c[0]), c[1], c[2], str(c[3])) for c in calls),
        )
    if kind == "u":
        index, prompt_index, prompt, completion, cached = fields
        usage = UsageCounts(_int(prompt), _int(completion), _int(cached))
        return ChoiceUsage(_int(index), _int(prompt_index), usage)
    raise ValueError(f"unknown item {kind!r}")


def _int(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int):
        raise TypeError(f"not an integer: {value!r}")
    return value
