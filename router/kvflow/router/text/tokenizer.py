"""The model's tokenizer, loaded from a Hugging Face folder or a GGUF file.

A GGUF file carries the whole tokenizer as metadata (tokens, merges, token types, the
pre-tokenizer's name); we rebuild it as a `tokenizers` byte-level BPE, which is what the
Hugging Face folder of the same model holds in tokenizer.json.
"""

from __future__ import annotations

import json
from collections.abc import Sequence
from dataclasses import dataclass
from functools import cached_property
from pathlib import Path

from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers

from kvflow.router.text.gguf_metadata import MetadataValue

# GGUF token types (llama.cpp `llama_token_type`).
_TOKEN_TYPE_CONTROL = 3
_TOKEN_TYPE_USER_DEFINED = 4

# llama.cpp's pre-tokenizer names -> the `tokenizers` pre-tokenizer that splits identically.
# "smollm" is single digits + the GPT-2 byte-level split; "gpt2" is the split alone.
_SUPPORTED_PRE_TOKENIZERS = ("smollm", "gpt2", "gpt-2", "default")


class TokenizerLoadError(ValueError):
    """The model path holds no tokenizer we can load; the message says what to provide."""


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's reversible map of the 256 byte values onto printable characters."""
    printable = (
        list(range(ord("!"), ord("~") + 1))
        + list(range(ord("¡"), ord("¬") + 1))
        + list(range(ord("®"), ord("ÿ") + 1))
    )
    mapping = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in mapping:
            mapping[b] = chr(256 + extra)
            extra += 1
    return mapping


_UNICODE_TO_BYTE = {ch: b for b, ch in _bytes_to_unicode().items()}


@dataclass(frozen=True)
class TextTokenizer:
    """Encode and decode text for one model; immutable and safe to share across requests."""

    backend: Tokenizer
    special_token_ids: frozenset[int]
    is_byte_level: bool
    bos_token: str
    eos_token: str

    @property
    def vocab_size(self) -> int:
        return int(self.backend.get_vocab_size(with_added_tokens=True))

    def encode(self, text: str, *, add_special_tokens: bool) -> list[int]:
        """Token ids of ``text``; special tokens written in the text (``<|im_start|>``) parse."""
        ids: list[int] = self.backend.encode(text, add_special_tokens=add_special_tokens).ids
        return ids

    def encode_plain(self, text: str) -> list[int]:
        """Token ids of ``text`` with special tokens' text split into plain text tokens: a
        caller's ``<|im_start|>`` is text, never a control token (text/control_tokens.py)."""
        ids: list[int] = self._plain_backend.encode(text, add_special_tokens=False).ids
        return ids

    @cached_property
    def _plain_backend(self) -> Tokenizer:
        # A copy: the flag is the tokenizer's, and the shared one must keep parsing them.
        plain = Tokenizer.from_str(self.backend.to_str())
        plain.encode_special_tokens = True
        return plain

    def decode(self, token_ids: Sequence[int], *, skip_special_tokens: bool = True) -> str:
        text: str = self.backend.decode(list(token_ids), skip_special_tokens=skip_special_tokens)
        return text

    def token_to_id(self, token: str) -> int | None:
        token_id: int | None = self.backend.token_to_id(token)
        return token_id

    @cached_property
    def _byte_table(self) -> tuple[bytes, ...]:
        # Built on first use (about 50 ms for 49k tokens), then O(1) per token.
        size = self.vocab_size
        table = [b""] * size
        for token, token_id in self.backend.get_vocab(with_added_tokens=True).items():
            if token_id >= size or token_id in self.special_token_ids:
                continue
            if all(ch in _UNICODE_TO_BYTE for ch in token):
                table[token_id] = bytes(_UNICODE_TO_BYTE[ch] for ch in token)
            else:  # an added, non-special token is stored as plain text
                table[token_id] = token.encode()
        return tuple(table)

    def token_text(self, token_id: int) -> tuple[str, bytes]:
        """A token as logprobs show it: its text (special tokens by name) and its bytes."""
        data = self.token_bytes(token_id)
        if data or token_id not in self.special_token_ids:
            return data.decode("utf-8", errors="replace"), data
        name = self.decode([token_id], skip_special_tokens=False)
        return name, name.encode()

    def token_bytes(self, token_id: int) -> bytes:
        """The UTF-8 bytes a token stands for (b"" for special tokens).

        Exact for byte-level BPE; other tokenizers fall back to decoding the single token.
        """
        if self.is_byte_level:
            table = self._byte_table
            return table[token_id] if 0 <= token_id < len(table) else b""
        return self.decode([token_id]).encode()


def _special_ids(backend: Tokenizer) -> frozenset[int]:
    return frozenset(
        token_id for token_id, added in backend.get_added_tokens_decoder().items() if added.special
    )


def _is_byte_level(backend: Tokenizer) -> bool:
    return isinstance(backend.decoder, decoders.ByteLevel)


def _merge_pair(merge: str) -> tuple[str, str]:
    left, _, right = merge.partition(" ")
    return left, right


def tokenizer_from_gguf_metadata(metadata: dict[str, MetadataValue]) -> TextTokenizer:
    """Rebuild a GGUF file's byte-level BPE tokenizer (llama.cpp model "gpt2")."""
    model_kind = metadata.get("tokenizer.ggml.model")
    pre_kind = str(metadata.get("tokenizer.ggml.pre", "default"))
    if model_kind != "gpt2":
        raise TokenizerLoadError(
            f"GGUF tokenizer model {model_kind!r} is not supported (only byte-level BPE, "
            "'gpt2'); pass --model a Hugging Face folder with tokenizer.json instead"
        )
    if pre_kind not in _SUPPORTED_PRE_TOKENIZERS:
        raise TokenizerLoadError(
            f"GGUF pre-tokenizer {pre_kind!r} is not supported "
            f"({', '.join(_SUPPORTED_PRE_TOKENIZERS)}); "
            "pass --model a Hugging Face folder with tokenizer.json instead"
        )
    tokens = metadata["tokenizer.ggml.tokens"]
    merges = metadata["tokenizer.ggml.merges"]
    token_types = metadata.get("tokenizer.ggml.token_type", [])
    assert isinstance(tokens, list) and isinstance(merges, list) and isinstance(token_types, list)
    vocab = {str(token): token_id for token_id, token in enumerate(tokens)}
    merge_pairs = [_merge_pair(str(m)) for m in merges]
    backend = Tokenizer(models.BPE(vocab=vocab, merges=merge_pairs, fuse_unk=False))
    byte_level = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    if pre_kind == "smollm":
        backend.pre_tokenizer = pre_tokenizers.Sequence(
            [pre_tokenizers.Digits(individual_digits=True), byte_level]
        )
    else:
        backend.pre_tokenizer = byte_level
    backend.decoder = decoders.ByteLevel()
    added = [
        AddedToken(str(tokens[i]), special=(kind == _TOKEN_TYPE_CONTROL), normalized=False)
        for i, kind in enumerate(token_types)
        if kind in (_TOKEN_TYPE_CONTROL, _TOKEN_TYPE_USER_DEFINED)
    ]
    backend.add_tokens(added)  # keeps their ids: they are already in the vocab

    def token_at(key: str) -> str:
        index = metadata.get(key)
        return str(tokens[index]) if isinstance(index, int) and 0 <= index < len(tokens) else ""

    return TextTokenizer(
        backend=backend,
        special_token_ids=_special_ids(backend),
        is_byte_level=True,
        bos_token=token_at("tokenizer.ggml.bos_token_id"),
        eos_token=token_at("tokenizer.ggml.eos_token_id"),
    )


def _token_text(value: object) -> str:
    # tokenizer_config.json writes special tokens either as strings or as AddedToken dicts.
    if isinstance(value, dict):
        return str(value.get("content", ""))
    return value if isinstance(value, str) else ""


def tokenizer_from_folder(folder: Path) -> tuple[TextTokenizer, dict[str, object]]:
    """The tokenizer of a Hugging Face model folder, plus its tokenizer_config.json."""
    tokenizer_json = folder / "tokenizer.json"
    if not tokenizer_json.is_file():
        raise TokenizerLoadError(
            f"{folder} has no tokenizer.json; pass --model a Hugging Face model folder "
            "(with tokenizer.json) or a GGUF file"
        )
    backend = Tokenizer.from_file(str(tokenizer_json))
    config_path = folder / "tokenizer_config.json"
    config: dict[str, object] = json.loads(config_path.read_text()) if config_path.is_file() else {}
    tokenizer = TextTokenizer(
        backend=backend,
        special_token_ids=_special_ids(backend),
        is_byte_level=_is_byte_level(backend),
        bos_token=_token_text(config.get("bos_token")),
        eos_token=_token_text(config.get("eos_token")),
    )
    return tokenizer, config
