"""What the semantic cache's tests share: a model version to scope entries by, a chat body,
and unit vectors at an angle (cos of the angle is their similarity)."""

from __future__ import annotations

import math
from typing import Any

from kvflow.proto import worker_pb2 as pb
from kvflow.router.caches.key import model_version

INFO = pb.WorkerInfo(
    model="m", hash_seed=b"\x01" * 16, vocab_size=100, max_model_len=512, eos_token_ids=[2]
)
VERSION = model_version("pool-a", "m", INFO, "{{ messages }}")


def chat(text: str, **extra: Any) -> dict[str, Any]:
    messages = [*extra.pop("before", []), {"role": "user", "content": text}]
    return {"model": "m", "messages": messages, "temperature": 0, "max_tokens": 8, **extra}


def unit(angle: float) -> tuple[float, float]:
    return (math.cos(angle), math.sin(angle))
