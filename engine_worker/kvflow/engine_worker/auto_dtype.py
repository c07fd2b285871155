"""What `--dtype auto`, the default, means: the checkpoint's own dtype, where the device
computes it natively; float32 otherwise.

- A **Hugging Face folder** says its dtype in `config.json` (`torch_dtype`, or `dtype` in
  newer files): bfloat16 for nearly every model published since Llama 2. Such a
  checkpoint runs in bfloat16 on a GPU that has it (compute capability 8.0 and up: A100,
  H100, L4...) and on a CPU with native bf16 dot products (x86 `avx512_bf16` or `amx_bf16`
  in /proc/cpuinfo), where torch's bf16 GEMMs run about 4x its float32 ones and the engine
  serves 1.5x the tokens (docs/benchmarks.md, "bf16 by default for a bf16 checkpoint").
  Elsewhere bf16 would be emulated (and float16 is not a dtype the engine runs), so it runs
  in float32: on an AVX2-only EPYC a step's products at 64 rows took 4.8-5.7x float32's
  time in bf16 (0.5-0.7x at one row, from half the bytes; bench/linear_dtype.py).
- A **GGUF file** (the built-in model among them) runs in float32, as llama.cpp computes
  over its quantized weights; a GGUF says nothing about what its publisher ran it in. A
  small model's logits have near-ties that bf16 flips: SmolLM2-135M's first answer token
  to "What is the capital of France?" is "The" at 25.33 against "L" at 25.24 in float32,
  bf16 logits that size are 0.125 apart, and the engine's bf16 answer becomes "L'Etoile,
  la Marseillaise, la femme, la femme..." instead of "The capital of France is Paris."
- A float32 checkpoint runs in float32.

vLLM's `auto` is the same idea (the checkpoint's dtype). The choice is pure
(`choose_dtype`) over what the checkpoint and the machine say (`machine_dtype`), so every
kind of machine is tested on any one of them.
"""

from __future__ import annotations

import json
from collections.abc import Collection
from pathlib import Path

CPU_BF16_FLAGS = frozenset({"avx512_bf16", "amx_bf16"})
HALF = frozenset({"bfloat16", "float16"})


def cpu_flags(cpuinfo: str) -> frozenset[str]:
    """The instruction-set flags of /proc/cpuinfo's text (x86 `flags`)."""
    for line in cpuinfo.splitlines():
        key, _, value = line.partition(":")
        if key.strip() == "flags":
            return frozenset(value.split())
    return frozenset()


def checkpoint_dtype(model: str | None) -> str:
    """The dtype a model path was published in: config.json's for a Hugging Face folder,
    "gguf" for a GGUF file or the built-in model, "float32" when a folder does not say."""
    if model is None or not Path(model).expanduser().is_dir():
        return "gguf"  # the built-in model, a .gguf, or a path the loader will refuse
    try:
        config = json.loads((Path(model).expanduser() / "config.json").read_text())
    except (OSError, ValueError):
        return "float32"  # the loader names what is wrong with the folder
    dtype = config.get("torch_dtype") or config.get("dtype") or "float32"
    return str(dtype).removeprefix("torch.")


def choose_dtype(
    requested: str, device: str, *, checkpoint: str, cpu_flags: Collection[str], cuda_bf16: bool
) -> tuple[str, str]:
    """(dtype, why) for a worker asked for ``requested`` on ``device``."""
    if requested != "auto":
        return requested, "as asked"
    if checkpoint == "gguf":
        return "float32", "auto: a GGUF runs in float32, as llama.cpp computes"
    if checkpoint not in HALF:
        return "float32", f"auto: the checkpoint is {checkpoint}"
    if device.startswith("cuda"):
        if cuda_bf16:
            return "bfloat16", f"auto: the checkpoint is {checkpoint}, the GPU computes bfloat16"
        return "float32", "auto: the GPU has no bfloat16 (compute capability below 8.0)"
    native = sorted(CPU_BF16_FLAGS & set(cpu_flags))
    if native:
        return "bfloat16", f"auto: the checkpoint is {checkpoint}, the CPU has {', '.join(native)}"
    return "float32", "auto: the CPU has no native bfloat16 (avx512_bf16 or amx_bf16)"


def machine_dtype(requested: str, device: str, model: str | None) -> tuple[str, str]:
    """`choose_dtype` on what the checkpoint at ``model`` and this machine say."""
    if requested != "auto":
        return requested, "as asked"
    cuda_bf16 = False
    if device.startswith("cuda"):
        import torch

        # Native only: with emulation (the default) a pre-Ampere GPU says yes too.
        cuda_bf16 = bool(torch.cuda.is_bf16_supported(including_emulation=False))
    try:
        flags = cpu_flags(Path("/proc/cpuinfo").read_text())
    except OSError:
        flags = frozenset()
    return choose_dtype(
        requested, device, checkpoint=checkpoint_dtype(model), cpu_flags=flags, cuda_bf16=cuda_bf16
    )
