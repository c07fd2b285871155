"""Incremental detokenization that never splits a multi-byte character.

Byte-level BPE tokens stand for raw bytes, and one emoji can span two tokens. We keep the
bytes in an incremental UTF-8 decoder, which holds back an unfinished character until its
last byte arrives: O(1) per token. Other tokenizers (SentencePiece-style decoders that merge
spaces across tokens) go through `_WindowDetokenizer`, which re-decodes a short window.
"""

from __future__ import annotations

import codecs
from collections.abc import Iterable

from kvflow.router.text.tokenizer import TextTokenizer

REPLACEMENT_CHAR = "\ufffd"


class _ByteDetokenizer:
    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
        self._keep_special = not skip_special_tokens

    def _bytes(self, token_id: int) -> bytes:
        if self._keep_special and token_id in self._tokenizer.special_token_ids:
            return self._tokenizer.decode([token_id], skip_special_tokens=False).encode()
        return self._tokenizer.token_bytes(token_id)

    def push(self, token_ids: Iterable[int]) -> str:
        data = b"".join(self._bytes(t) for t in token_ids)
        return self._decoder.decode(data, final=False)

    def flush(self) -> str:
        return self._decoder.decode(b"", final=True)


class _WindowDetokenizer:
    """Decode ids[prefix:] and emit what goes beyond ids[prefix:read], once it is whole."""

    def __init__(self, tokenizer: TextTokenizer, skip_special_tokens: bool) -> None:
        self._tokenizer = tokenizer
        self._skip_special = skip_special_tokens
        self._token_ids: list[int] = []
        self._prefix_offset = 0
        self._read_offset = 0

    def _window_text(self, end: int) -> str:
        window = self._token_ids[self._prefix_offset : end]
        return self._tokenizer.decode(window, skip_special_tokens=self._skip_special)

    def push(self, token_ids: Iterable[int]) -> str:
        self._token_ids.extend(token_ids)
        seen = self._window_text(self._read_offset)
        full = self._window_text(len(self._token_ids))
        if len(full) <= len(seen) or full.endswith(REPLACEMENT_CHAR):
            return ""  # an unfinished character: wait for the next token
        self._prefix_offset = self._read_offset
        self._read_offset = len(self._token_ids)
        return full[len(seen) :]

    def flush(self) -> str:
        seen = self._window_text(self._read_offset)
        full = self._window_text(len(self._token_ids))
        self._read_offset = len(self._token_ids)
        return full[len(seen) :]


class IncrementalDetokenizer:
    """Feed token ids as they stream in; get back only complete text. Special tokens vanish
    unless ``skip_special_tokens`` is False (vLLM's option): then they appear by name."""

    def __init__(self, tokenizer: TextTokenizer, *, skip_special_tokens: bool = True) -> None:
        self._impl: _ByteDetokenizer | _WindowDetokenizer
        if tokenizer.is_byte_level:
            self._impl = _ByteDetokenizer(tokenizer, skip_special_tokens)
        else:
            self._impl = _WindowDetokenizer(tokenizer, skip_special_tokens)

    def push(self, token_ids: Iterable[int]) -> str:
        return self._impl.push(token_ids)

    def flush(self) -> str:
        """The rest at the end of the stream (a truncated character becomes U+FFFD)."""
        return self._impl.flush()
