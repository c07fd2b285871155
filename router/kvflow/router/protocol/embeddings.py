"""OpenAI's embeddings request (`POST /v1/embeddings`), parsed and checked: pure.

`input` is a string, a list of strings, a list of token ids, or a list of such lists (ids
of the embedding model's own tokenizer); `encoding_format` "float" (the default) or
"base64" (little-endian float32, as OpenAI sends); `dimensions` the length wanted, one the
model was trained to cut to. Every problem is a 400 naming its field. What depends on the
model (how many inputs, which dimensions) is checked against the pool's embedding workers
in `check_against`; input longer than the model takes is refused by the worker itself,
which alone tokenizes.
"""

from __future__ import annotations

import base64
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from kvflow.proto import worker_pb2 as pb
from kvflow.router.protocol.errors import invalid_request

ENCODING_FORMATS = ("float", "base64")
PARAMETERS = ("model", "input", "encoding_format", "dimensions", "user")
# Token ids and dimensions travel as int32 (worker.proto).
MAX_INT32 = 2**31 - 1

Input = str | tuple[int, ...]


@dataclass(frozen=True)
class EmbeddingRequest:
    model: str
    inputs: tuple[Input, ...]
    encoding_format: str = "float"
    dimensions: int | None = None  # None: the model's own
    user: str | None = None

    @property
    def floor_tokens(self) -> int:
        """The fewest tokens it can use: a token array's length, at least one per text."""
        return sum(1 if isinstance(x, str) else len(x) for x in self.inputs)


def _is_int(x: object) -> bool:
    return isinstance(x, int) and not isinstance(x, bool)


def _is_token(x: object) -> bool:
    return _is_int(x) and 0 <= x <= MAX_INT32  # type: ignore[operator]


def _inputs(raw: object) -> tuple[Input, ...]:
    shape = (
        "'input' must be a string, an array of strings, an array of token ids (integers) or "
        "an array of token-id arrays"
    )
    if isinstance(raw, str):
        items: list[object] = [raw]
    elif isinstance(raw, list) and raw and all(_is_int(x) for x in raw):
        items = [raw]  # one token array
    elif isinstance(raw, list):
        items = raw
    else:
        raise invalid_request(f"{shape}; got {type(raw).__name__}.", param="input")
    if not items:
        raise invalid_request("'input' is empty: send at least one text.", param="input")
    out: list[Input] = []
    for i, item in enumerate(items):
        if isinstance(item, str):
            if not item:
                raise invalid_request(f"'input'[{i}] is an empty string.", param="input")
            out.append(item)
        elif isinstance(item, list) and all(_is_int(t) for t in item):
            if not item:
                raise invalid_request(f"'input'[{i}] is an empty token array.", param="input")
            if not all(_is_token(t) for t in item):
                raise invalid_request(
                    f"'input'[{i}] holds a negative or oversized token id.", param="input"
                )
            out.append(tuple(item))
        else:
            raise invalid_request(f"{shape}; 'input'[{i}] is neither.", param="input")
    return tuple(out)


def parse_embedding_request(body: object) -> EmbeddingRequest:
    if not isinstance(body, dict):
        raise invalid_request("The request body must be a JSON object.")
    b: dict[str, Any] = body
    unknown = sorted(k for k in b if k not in PARAMETERS)
    if unknown:
        raise invalid_request(
            f"Unrecognized request argument supplied: {unknown[0]}. /v1/embeddings takes "
            f"{', '.join(PARAMETERS)}.",
            param=unknown[0],
        )
    model = b.get("model")
    if not isinstance(model, str) or not model:
        raise invalid_request("'model' is required: the embedding model's name.", param="model")
    if "input" not in b:
        raise invalid_request("'input' is required: the text(s) to embed.", param="input")
    encoding = b.get("encoding_format", "float")
    if encoding is None:
        encoding = "float"
    if encoding not in ENCODING_FORMATS:
        raise invalid_request(
            f"'encoding_format' must be one of {list(ENCODING_FORMATS)}; got {encoding!r}.",
            param="encoding_format",
        )
    dimensions = b.get("dimensions")
    if dimensions is not None and (not _is_token(dimensions) or dimensions < 1):
        raise invalid_request(
            f"'dimensions' must be a positive integer; got {dimensions!r}.", param="dimensions"
        )
    user = b.get("user")
    if user is not None and not isinstance(user, str):
        raise invalid_request("'user' must be a string.", param="user")
    return EmbeddingRequest(model, _inputs(b["input"]), encoding, dimensions, user)


def check_against(request: EmbeddingRequest, info: pb.EmbeddingInfo, served_name: str) -> None:
    """400 for more inputs than the model takes, or dimensions it was not trained for."""
    if info.max_inputs and len(request.inputs) > info.max_inputs:
        raise invalid_request(
            f"'input' has {len(request.inputs)} items; '{served_name}' takes at most "
            f"{info.max_inputs} per request.",
            param="input",
        )
    allowed = list(info.allowed_dimensions)
    if request.dimensions is not None and request.dimensions not in allowed:
        raise invalid_request(
            f"'dimensions' {request.dimensions} is not supported by '{served_name}': it makes "
            f"embeddings of {allowed} dimensions.",
            param="dimensions",
        )


def encode_vector(vector: Sequence[float], encoding_format: str) -> list[float] | str:
    """As the response's `embedding`: the floats, or base64 of little-endian float32."""
    if encoding_format == "base64":
        return base64.b64encode(np.asarray(vector, dtype="<f4").tobytes()).decode("ascii")
    return list(vector)


def embeddings_body(
    vectors: Sequence[Sequence[float]], encoding_format: str, model: str, prompt_tokens: int
) -> dict[str, Any]:
    return {
        "object": "list",
        "data": [
            {"object": "embedding", "index": i, "embedding": encode_vector(v, encoding_format)}
            for i, v in enumerate(vectors)
        ],
        "model": model,
        "usage": {"prompt_tokens": prompt_tokens, "total_tokens": prompt_tokens},
    }
