"""The bytes a model's weights take on its device, by tensor dtype.

The one place that counts them: the start-up log line, ``/metrics``
(``kvflow_worker_weight_bytes{dtype}``) and the GPU memory budget all read it. Buffers count
as well as parameters: quantized weights are stored as packed integer buffers (and RoPE's
tables are buffers too: SmolLM2's are 2 MiB of float32 beside 0.5 GiB of weights).
"""

from __future__ import annotations

from torch import nn


def weight_memory(model: nn.Module) -> dict[str, int]:
    """Bytes of every parameter and buffer of ``model``, summed per dtype name
    (``{"bfloat16": ..., "float32": ...}``); a quantized matrix's packed codes and scales
    count as what they hold: ``int4`` (``quant/int4_weight.py``: 4-bit planes with bf16
    scales) or ``fp8`` (``quant/fp8_weight.py``). A tensor reachable twice (tied
    embeddings, a shared buffer) or two views of one memory count once."""
    kinds = {
        id(tensor): kind
        for module in model.modules()
        if (kind := _quantized_kind(module)) is not None
        for tensor in module.buffers()
    }
    seen: set[tuple[int, int]] = set()
    totals: dict[str, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "meta":
            continue  # no memory behind it
        key = (tensor.data_ptr(), tensor.nbytes)
        if key in seen:
            continue
        seen.add(key)
        name = kinds.get(id(tensor)) or str(tensor.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + tensor.nbytes
    return dict(sorted(totals.items()))


def _quantized_kind(module: nn.Module) -> str | None:
    from kvflow.engine_worker.model.quant.fp8_weight import Fp8Weight
    from kvflow.engine_worker.model.quant.int4_weight import Int4Weight

    if isinstance(module, Int4Weight):
        return "int4"
    if isinstance(module, Fp8Weight):
        return "fp8"
    return None
