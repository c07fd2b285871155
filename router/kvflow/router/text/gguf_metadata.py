"""Read the key/value metadata of a GGUF file, and nothing else.

`gguf.GGUFReader` also maps every tensor (about 3 s for SmolLM2-135M on a 2-core machine);
the tokenizer needs only the metadata block at the start of the file, which this reads in
about 0.1 s. Format: https://github.com/ggml-org/ggml/blob/master/docs/gguf.md (v2 and v3).
"""

from __future__ import annotations

import struct
from pathlib import Path
from typing import BinaryIO

GGUF_MAGIC = b"GGUF"
MetadataValue = int | float | bool | str | list["MetadataValue"]

# Value type codes of the GGUF spec -> struct format (scalars) or a marker.
_SCALAR_FORMATS = {
    0: "<B",  # uint8
    1: "<b",  # int8
    2: "<H",  # uint16
    3: "<h",  # int16
    4: "<I",  # uint32
    5: "<i",  # int32
    6: "<f",  # float32
    7: "<?",  # bool
    10: "<Q",  # uint64
    11: "<q",  # int64
    12: "<d",  # float64
}
_STRING = 8
_ARRAY = 9


class GgufFormatError(ValueError):
    """The file is not a GGUF file this reader understands."""


def _read_exact(f: BinaryIO, num_bytes: int) -> bytes:
    data = f.read(num_bytes)
    if len(data) != num_bytes:
        raise GgufFormatError("unexpected end of file in the GGUF metadata")
    return data


def _read_scalar(f: BinaryIO, fmt: str) -> int | float | bool:
    value: int | float | bool
    (value,) = struct.unpack(fmt, _read_exact(f, struct.calcsize(fmt)))
    return value


def _read_string(f: BinaryIO) -> str:
    (length,) = struct.unpack("<Q", _read_exact(f, 8))
    return _read_exact(f, length).decode("utf-8", errors="replace")


def _read_value(f: BinaryIO, type_code: int) -> MetadataValue:
    if type_code == _STRING:
        return _read_string(f)
    if type_code == _ARRAY:
        (item_type,) = struct.unpack("<I", _read_exact(f, 4))
        (count,) = struct.unpack("<Q", _read_exact(f, 8))
        if item_type in _SCALAR_FORMATS:
            # One unpack for the whole array: 49k token types in a single call.
            fmt = _SCALAR_FORMATS[item_type]
            size = struct.calcsize(fmt)
            values = struct.unpack(f"<{count}{fmt[1]}", _read_exact(f, size * count))
            return list(values)
        return [_read_value(f, item_type) for _ in range(count)]
    if type_code not in _SCALAR_FORMATS:
        raise GgufFormatError(f"unknown GGUF value type {type_code}")
    return _read_scalar(f, _SCALAR_FORMATS[type_code])


def read_gguf_metadata(path: str | Path) -> dict[str, MetadataValue]:
    """Every metadata key of the GGUF file at ``path`` (tensors are not read)."""
    with open(path, "rb") as f:
        if _read_exact(f, 4) != GGUF_MAGIC:
            raise GgufFormatError(f"{path} is not a GGUF file (bad magic)")
        (version,) = struct.unpack("<I", _read_exact(f, 4))
        if version not in (2, 3):
            raise GgufFormatError(f"{path}: GGUF version {version} is not supported (2, 3)")
        _num_tensors, num_kv = struct.unpack("<QQ", _read_exact(f, 16))
        metadata: dict[str, MetadataValue] = {}
        for _ in range(num_kv):
            key = _read_string(f)
            (type_code,) = struct.unpack("<I", _read_exact(f, 4))
            metadata[key] = _read_value(f, type_code)
        return metadata
