"""`kvflow up` with several models, pure: pair --model with --served-model-name by
position, name a pool for each, and write the router's `pools:` config."""

from __future__ import annotations

import json
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

DEFAULT_SERVED_MODEL_NAME = "smollm2"


class UpModelsError(ValueError):
    """The --model / --served-model-name flags do not pair up; the message says how."""


@dataclass(frozen=True)
class UpModel:
    served_model_name: str
    model: str | None  # HF folder or .gguf; None: the built-in SmolLM2 GGUF
    pool: str  # the router config's pool name (a DNS-1123 label)


def _pool_name(served_model_name: str, taken: set[str], index: int) -> str:
    label = re.sub(r"[^a-z0-9-]+", "-", served_model_name.lower()).strip("-")[:63].strip("-")
    label = label or f"pool-{index + 1}"
    name, n = label, 2
    while name in taken:
        suffix = f"-{n}"
        name, n = label[: 63 - len(suffix)] + suffix, n + 1
    return name


def pair_models(models: Sequence[str] | None, names: Sequence[str] | None) -> list[UpModel]:
    """--model and --served-model-name, paired by position. One model: the flags as
    before (each optional). Several: one served name each, and either no --model (every
    one the built-in model) or one --model per name."""
    models, names = list(models or []), list(names or [])
    if len(models) > 1 and len(names) != len(models):
        raise UpModelsError(
            f"{len(models)} --model flags need as many --served-model-name flags (paired by "
            f"position), got {len(names)}"
        )
    if len(names) > 1 and len(models) not in (0, len(names)):
        raise UpModelsError(
            f"{len(names)} --served-model-name flags need no --model (each the built-in "
            f"model) or one --model each, paired by position; got {len(models)}"
        )
    if len(set(names)) != len(names):
        raise UpModelsError(f"each --served-model-name must differ, got {names}")
    names = names or [DEFAULT_SERVED_MODEL_NAME]
    taken: set[str] = set()
    paired = []
    for i, name in enumerate(names):
        pool = _pool_name(name, taken, i)
        taken.add(pool)
        paired.append(UpModel(name, models[i] if models else None, pool))
    return paired


def router_config(models: Sequence[UpModel], addresses: Sequence[Sequence[str]]) -> dict[str, Any]:
    """The router's config for several models: one pool per model with its workers'
    addresses (``addresses[i]`` for ``models[i]``); each pool answers to its served name."""
    pools = []
    for up_model, workers in zip(models, addresses, strict=True):
        pool: dict[str, Any] = {"name": up_model.pool,
                                "served_model_name": up_model.served_model_name,
                                "workers": list(workers)}  # fmt: skip
        if up_model.model is not None:
            pool["model"] = up_model.model
        pools.append(pool)
    return {"pools": pools}


def examples_many(url: str, names: Sequence[str]) -> str:
    """What `kvflow up` prints with several models: a curl per name, and an openai loop
    over all of them (each response's `model` says who answered)."""
    curls = []
    for name in names:
        body = json.dumps({"model": name, "max_tokens": 100,
                           "messages": [{"role": "user", "content": "Who are you?"}]})  # fmt: skip
        curls.append(
            f"curl {url}/v1/chat/completions \\\n"
            f"  -H 'Content-Type: application/json' \\\n"
            f"  -d '{body}'"
        )
    quoted = ", ".join(f'"{n}"' for n in names)
    curl_text = "\n\n".join(curls)
    return f"""
kvflow is running: {url}/v1  (models {quoted})

Try each with curl:

{curl_text}

or with the openai package (pip install openai):

python - <<'EOF'
from openai import OpenAI
client = OpenAI(base_url="{url}/v1", api_key="unused")
for model in [{quoted}]:
    response = client.chat.completions.create(
        model=model,
        messages=[{{"role": "user", "content": "Tell me about the sea."}}],
        max_tokens=50,
    )
    print(response.model, "->", response.choices[0].message.content)
EOF

Press Ctrl-C to stop."""
