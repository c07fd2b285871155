"""The tokenizer's vocabulary as bytes per token id: what a grammar mask is computed over.

Workers speak token ids and never tokenize text, but a grammar constrains *bytes*, so the
mask needs to know which bytes each token id stands for. Read here from the same model
files the worker loads (``model/``): a Hugging Face folder's ``tokenizer.json`` or a GGUF
file's ``tokenizer.ggml.*`` metadata. Byte-level BPE (GPT-2, Llama 3, Qwen, SmolLM2) and
SentencePiece (Llama 2, Mistral) vocabularies are both decoded to exact bytes.
"""

from __future__ import annotations

import functools
import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from kvflow.engine_worker.model.default_model import default_model_path
from kvflow.engine_worker.model.errors import ModelLoadError

_SPIECE_SPACE = "\u2581"  # SentencePiece writes a leading space as "▁"
_BYTE_TOKEN = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")  # SentencePiece byte fallback
# GGUF token types (llama.cpp's llama_token_type): 3 control, 4 user-defined, 6 byte.
_GGUF_CONTROL, _GGUF_USER_DEFINED, _GGUF_BYTE = 3, 4, 6


@dataclass(frozen=True)
class Vocabulary:
    """Bytes of every token id, and which ids are special (never produced from text)."""

    token_bytes: tuple[bytes, ...]
    special_token_ids: frozenset[int]
    eos_token_ids: tuple[int, ...]
    # A Hugging Face tokenizer.json, when the model has one: the grammar engine then
    # tokenizes forced text exactly as the model would (else greedily, longest match).
    tokenizer_json: str | None = None

    @property
    def num_tokens(self) -> int:
        return len(self.token_bytes)


@functools.cache
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's printable stand-ins for bytes, inverted: "Ġ" -> 0x20, "Ċ" -> 0x0A."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAC + 1), *range(0xAE, 0xFF + 1)]
    chars = list(printable)
    shift = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + shift)
            shift += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _byte_level(token: str) -> bytes:
    decoder = _byte_level_decoder()
    try:
        return bytes(decoder[ch] for ch in token)
    except KeyError:  # an added token written as plain text (e.g. "<tool_call>")
        return token.encode()


def _sentencepiece(token: str) -> bytes:
    match = _BYTE_TOKEN.match(token)
    if match:
        return bytes([int(match.group(1), 16)])
    return token.replace(_SPIECE_SPACE, " ").encode()


def vocabulary_from_gguf(path: Path, eos_token_ids: tuple[int, ...]) -> Vocabulary:
    from gguf import GGUFReader  # the worker's dependency already

    fields = GGUFReader(str(path)).fields
    try:
        model = fields["tokenizer.ggml.model"].contents()
        tokens = fields["tokenizer.ggml.tokens"].contents()
    except KeyError as err:
        raise ModelLoadError(f"{path} has no tokenizer ({err.args[0]} is missing)") from err
    types_field = fields.get("tokenizer.ggml.token_type")
    types = types_field.contents() if types_field is not None else [1] * len(tokens)
    if model == "gpt2":
        decode = _byte_level
    elif model == "llama":
        decode = _sentencepiece
    else:
        raise ModelLoadError(
            f"{path}: tokenizer model {model!r} is not supported for structured output "
            "(supported: gpt2 byte-level BPE, llama SentencePiece)"
        )
    token_bytes = []
    special = set()
    for i, (token, kind) in enumerate(zip(tokens, types, strict=True)):
        if kind in (_GGUF_CONTROL, _GGUF_USER_DEFINED):
            token_bytes.append(token.encode())
            if kind == _GGUF_CONTROL:
                special.add(i)
        else:
            token_bytes.append(decode(token))
    return Vocabulary(tuple(token_bytes), frozenset(special), eos_token_ids)


def vocabulary_from_tokenizer_json(path: Path, eos_token_ids: tuple[int, ...]) -> Vocabulary:
    try:
        text = path.read_text()
        raw: dict[str, Any] = json.loads(text)
        model = raw["model"]
        vocab: dict[str, int] = model["vocab"]
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise ModelLoadError(f"{path} is not a readable tokenizer.json: {err}") from err
    if not isinstance(vocab, dict):  # Unigram models list [piece, score] pairs
        vocab = {piece: i for i, (piece, _score) in enumerate(vocab)}
    is_byte_level = _uses_byte_level(raw)
    decode = _byte_level if is_byte_level else _sentencepiece
    by_id: dict[int, bytes] = {i: decode(piece) for piece, i in vocab.items()}
    special = set()
    for added in raw.get("added_tokens", []):
        by_id[added["id"]] = added["content"].encode()
        if added.get("special", False):
            special.add(added["id"])
    num_tokens = max(by_id) + 1
    token_bytes = tuple(by_id.get(i, b"") for i in range(num_tokens))
    return Vocabulary(token_bytes, frozenset(special), eos_token_ids, text)


def _uses_byte_level(raw: dict[str, Any]) -> bool:
    def mentions(node: Any) -> bool:
        if isinstance(node, dict):
            return node.get("type") == "ByteLevel" or any(mentions(v) for v in node.values())
        if isinstance(node, list):
            return any(mentions(v) for v in node)
        return False

    return mentions(raw.get("pre_tokenizer")) or mentions(raw.get("decoder"))


def load_vocabulary(model_path: str | Path | None, eos_token_ids: tuple[int, ...]) -> Vocabulary:
    """The vocabulary of the model ``load_model`` loads from ``model_path`` (None: default).

    Raises ``ModelLoadError`` when the files hold no tokenizer this module can read.
    """
    resolved = default_model_path() if model_path is None else Path(model_path).expanduser()
    if resolved.is_file() and resolved.suffix == ".gguf":
        return vocabulary_from_gguf(resolved, eos_token_ids)
    tokenizer_json = resolved / "tokenizer.json"
    if resolved.is_dir() and tokenizer_json.is_file():
        return vocabulary_from_tokenizer_json(tokenizer_json, eos_token_ids)
    raise ModelLoadError(
        f"{resolved} has no tokenizer.json: structured output needs the tokenizer's "
        "vocabulary next to the weights"
    )
