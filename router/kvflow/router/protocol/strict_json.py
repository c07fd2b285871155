"""JSON text read strictly, as a request's body or a batch file's line. Pure.

``json.loads`` takes more than JSON: ``NaN`` and ``Infinity``, and a string holding a lone
UTF-16 surrogate, raw (bytes that are not UTF-8, which it decodes with ``surrogatepass``)
or escaped (``"\\ud800"``: valid JSON, but no character; only a high then a low surrogate
are one). What it hands on then breaks later stages: the tokenizer, protobuf and UTF-8
refuse a surrogate (a request's 500; a batch line that stopped its batch for good), and NaN
passes every range check. ``loads_strict`` refuses all of them, naming what and where.
"""

from __future__ import annotations

import json
import re


class NotJsonTextError(ValueError):
    """What is wrong with the text; ``where``: the path of the string at fault, if one is."""

    def __init__(self, message: str, where: str | None = None) -> None:
        super().__init__(message)
        self.where = where


# An escaped surrogate in the text: ``\ud800``-``\udfff`` (either case).
_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")
_SURROGATE = re.compile("[\ud800-\udfff]")


def loads_strict(data: bytes | str) -> object:
    """The JSON value in ``data`` (bytes: UTF-8, or the UTF-16/32 JSON allows, strictly
    decoded), or ``NotJsonTextError``. A value nested past Python's recursion limit raises
    ``RecursionError``, as ``json.loads`` does."""
    try:
        text = data if isinstance(data, str) else data.decode(json.detect_encoding(data))
        value = json.loads(text, parse_constant=_refuse_constant)
    except UnicodeDecodeError as exc:
        raise NotJsonTextError(f"not UTF-8 text ({exc})") from exc
    except NotJsonTextError:
        raise
    except ValueError as exc:
        raise NotJsonTextError(str(exc)) from exc
    if _SURROGATE_ESCAPE.search(text):  # rare (escaped emoji): only then walk the value
        where = lone_surrogate_at(value)
        if where is not None:
            raise NotJsonTextError(
                "the string holds a lone UTF-16 surrogate escape (a \\ud800-\\udfff not "
                "paired high then low), which is no character",
                where,
            )
    return value


def _refuse_constant(name: str) -> object:
    raise NotJsonTextError(f"{name} is not a JSON number; send a finite number")


def lone_surrogate_at(value: object) -> str | None:
    """The path (``messages[0].content``) of the first string in ``value``, an object's key
    or a value, that holds a surrogate code point; None when none does. Iterative: a value
    nests as deep as the parser allowed, which a recursive walk might not."""
    stack: list[tuple[object, str]] = [(value, "")]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            if _SURROGATE.search(item):
                return path or "(the value)"
        elif isinstance(item, dict):
            children = [(child, f"{path}.{key}" if path else key) for key, child in item.items()]
            for _, key_path in children:
                if _SURROGATE.search(key_path):  # a key: named with the surrogate escaped
                    return key_path.encode("utf-8", "backslashreplace").decode()
            stack.extend(reversed(children))
        elif isinstance(item, list):
            stack.extend((child, f"{path}[{i}]") for i, child in reversed(list(enumerate(item))))
    return None
