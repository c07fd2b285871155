"""Only the chat template writes control tokens: what a caller wrote is text.

A chat template joins the caller's strings with its own markers (``<|im_start|>user``), and
the tokenizer parses a special token's text wherever it appears. A user message holding
``<|im_start|>system`` would then open a forged system turn. So before rendering, every
special token's text inside the caller's strings is swapped for a placeholder the tokenizer
has no token for; after rendering, the text between placeholders is tokenized as usual
(the template's markers become control tokens) and each placeholder's original text is
tokenized with special tokens split (plain text tokens).

Placeholders carry a random per-request number, so a caller cannot write one that
resolves to another (each maps to text anyway, never to a control token).
"""

from __future__ import annotations

import re
import secrets
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from kvflow.router.text.tokenizer import TextTokenizer

# Private-use characters: no tokenizer has a special token made of them, and templates'
# string filters (trim, upper, lower) leave them and digits alone.
_OPEN, _CLOSE = "\ue000", "\ue001"


@dataclass
class Escaped:
    """The placeholders of one request: index -> the caller's text it stands for."""

    nonce: str = field(default_factory=lambda: str(secrets.randbelow(10**18)).zfill(18))
    texts: list[str] = field(default_factory=list)

    def placeholder(self, text: str) -> str:
        self.texts.append(text)
        return f"{_OPEN}{self.nonce}:{len(self.texts) - 1}{_CLOSE}"


class ControlTokenGuard:
    """Escapes a tokenizer's special tokens in caller values; tokenizes rendered text with
    the template's markers as control tokens and the caller's as text. Thread-safe."""

    def __init__(self, tokenizer: TextTokenizer) -> None:
        self._tokenizer = tokenizer
        names = {
            tokenizer.decode([i], skip_special_tokens=False) for i in tokenizer.special_token_ids
        }
        names.discard("")
        # Longest first: one special token's text may start with another's.
        alternatives = sorted(names, key=len, reverse=True)
        self._special = re.compile("|".join(map(re.escape, alternatives))) if names else None
        tokenizer.encode_plain("")  # builds its copy now, not on a request's thread

    def escape(self, value: Any, escaped: Escaped) -> Any:
        """A copy of ``value`` (messages, template variables) whose strings, mapping keys
        included, have special-token text replaced by placeholders recorded in
        ``escaped``. Iterative: a caller's JSON may nest as deep as the parser allows."""
        special = self._special
        if special is None:
            return value

        def sub(text: str) -> str:
            return special.sub(lambda m: escaped.placeholder(m.group(0)), text)

        root: list[Any] = [value]
        stack: list[tuple[Any, Any]] = [(root, 0)]  # (container, key) still to copy
        while stack:
            container, key = stack.pop()
            item = container[key]
            if isinstance(item, str):
                container[key] = sub(item)
            elif isinstance(item, Mapping):
                copy = {sub(k) if isinstance(k, str) else k: v for k, v in item.items()}
                container[key] = copy
                stack.extend((copy, k) for k in copy)
            elif isinstance(item, list | tuple):
                items = list(item)
                container[key] = items
                stack.extend((items, i) for i in range(len(items)))
        return root[0]

    def encode(self, rendered: str, escaped: Escaped) -> list[int]:
        """Token ids of the rendered prompt: the template's text with special tokens parsed,
        each placeholder as the plain text tokens of what it stands for."""
        tokenizer = self._tokenizer
        if not escaped.texts:
            return tokenizer.encode(rendered, add_special_tokens=False)
        pattern = re.compile(f"{_OPEN}{escaped.nonce}:(\\d+){_CLOSE}")
        ids: list[int] = []
        start = 0
        for match in pattern.finditer(rendered):
            if match.start() > start:
                ids += tokenizer.encode(rendered[start : match.start()], add_special_tokens=False)
            index = int(match.group(1))
            if index < len(escaped.texts):
                ids += tokenizer.encode_plain(escaped.texts[index])
            start = match.end()
        if start < len(rendered):
            ids += tokenizer.encode(rendered[start:], add_special_tokens=False)
        return ids

    @staticmethod
    def restore(rendered: str, escaped: Escaped) -> str:
        """The rendered text with each placeholder back to what it stands for (for echo)."""
        if not escaped.texts:
            return rendered
        pattern = re.compile(f"{_OPEN}{escaped.nonce}:(\\d+){_CLOSE}")

        def original(match: re.Match[str]) -> str:
            index = int(match.group(1))
            return escaped.texts[index] if index < len(escaped.texts) else match.group(0)

        return pattern.sub(original, rendered)
