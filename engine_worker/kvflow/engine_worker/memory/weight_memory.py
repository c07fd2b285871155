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
    (``{"bfloat16": ..., "float32": ...}``). A tensor reachable twice (tied embeddings, a
    shared buffer) or two views of one memory count once."""
    seen: set[tuple[int, int]] = set()
    totals: dict[str, int] = {}
    for tensor in (*model.parameters(), *model.buffers()):
        if tensor.device.type == "meta":
            continue  # no memory behind it
        key = (tensor.data_ptr(), tensor.nbytes)
        if key in seen:
            continue
        seen.add(key)
        name = str(tensor.dtype).removeprefix("torch.")
        totals[name] = totals.get(name, 0) + tensor.nbytes
    return dict(sorted(totals.items()))
