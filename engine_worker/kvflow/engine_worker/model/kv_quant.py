"""Quantized KV cache rows: int8 or fp8 (e4m3) values with one float16 scale per token and head.

``--kv-cache-dtype int8|fp8`` stores each token's keys and values of each KV head as
``head_dim`` one-byte values followed by that row's scale (2 bytes, float16), symmetric:
``scale = amax / 127`` for int8 (values rounded to -127..127) and ``amax / 448`` for e4m3
(its largest finite value). This is LMDeploy's online int8 KV scheme: the scale is computed
when the token's K/V is written, from that token alone, so nothing is calibrated and a block
never needs requantizing when later tokens arrive.

Why the scale sits inside the row, not in a tensor beside the cache: a block of one layer
stays one contiguous run (``paged_cache.kv_cache_shape``), values and scales together, so a KV
transfer (kv_transfer/blocks.py, every transport), the prefix cache and CUDA-graph decode
move and address quantized blocks exactly as they do float ones, with no second stream.

Why float16 for the scale (2 bytes; bytes per token and head with SmolLM2's head_dim 64):

- float32 scale: 64 + 4 = 68 B against bfloat16's 128: 1.88x the tokens per byte.
- float16 scale: 66 B: 1.94x against bfloat16 (1.97x at head_dim 128), 3.88x against float32.
- bfloat16 scale: also 66 B, but its 8-bit mantissa rounds a scale by up to 2^-9 = 0.2 %,
  which moves every value of the row by half an int8 step (1/254 = 0.39 % of amax): as
  large as the quantization error itself. float16 rounds by 2^-12 = 0.024 %.

Exactly 2x against a 16-bit cache is out of reach of any scheme that stores a scale per
token (``2 * D / (D + s)`` < 2 for every ``s`` > 0); per-tensor static scales would reach it
and are what this scheme avoids (one outlier token would flatten every other token's values).
float16's range: scales are clamped to its smallest normal, 2^-14, so a row whose values are
all below 127 * 2^-14 = 0.0078 (int8) keeps an absolute precision of 3e-5, and to its
largest, 65504, which no activation reaches (int8 amax 8.3e6).

``write_quantized`` and ``gather_dequantized`` are ``attention``'s write and gather for such
a cache. Dequantized values are what attention reads everywhere (the step's own tokens included), so
a result does not depend on whether a token came from this step, the paged cache, a prefix
hit, a transfer or the decode workspace.
"""

from __future__ import annotations

import torch

# The command line's names; auto: the model's dtype (no quantization).
KV_CACHE_DTYPES = ("auto", "int8", "fp8")

SCALE_DTYPE = torch.float16
SCALE_BYTES = 2  # the scale's bytes at the end of each quantized row
_MIN_SCALE = 2.0**-14  # float16's smallest normal
_MAX_SCALE = 65504.0  # float16's largest finite value
_QMAX = {torch.int8: 127.0}


def _quantized_dtypes() -> dict[str, torch.dtype]:
    dtypes = {"int8": torch.int8}
    fp8 = getattr(torch, "float8_e4m3fn", None)
    if fp8 is not None:
        dtypes["fp8"] = fp8
        _QMAX[fp8] = 448.0  # e4m3fn's largest finite value
    return dtypes


QUANTIZED_DTYPES = _quantized_dtypes()


class KvCacheDtypeError(ValueError):
    """A --kv-cache-dtype this torch or device cannot store; the message says what to do."""


def kv_cache_dtype(name: str, model_dtype: torch.dtype) -> torch.dtype:
    """The cache's element dtype for ``--kv-cache-dtype name`` under a model in ``model_dtype``."""
    if name == "auto":
        return model_dtype
    if name == "fp8" and name not in QUANTIZED_DTYPES:
        raise KvCacheDtypeError(
            f"--kv-cache-dtype fp8 needs torch.float8_e4m3fn, which torch {torch.__version__} "
            "lacks: upgrade torch (2.1 or later) or use --kv-cache-dtype int8"
        )
    if name not in QUANTIZED_DTYPES:
        raise KvCacheDtypeError(f"--kv-cache-dtype {name!r}: choose one of {KV_CACHE_DTYPES}")
    return QUANTIZED_DTYPES[name]


def check_device_supports(dtype: torch.dtype, device: torch.device | str) -> None:
    """Raise KvCacheDtypeError unless ``device`` can quantize into and read back ``dtype``."""
    if not is_quantized(dtype):
        return
    try:
        probe = torch.tensor([[0.5, -3.0, 7.0, 1.0]], device=device)
        back = dequantize(quantize(probe, dtype), torch.float32)
    except (RuntimeError, TypeError) as exc:
        raise KvCacheDtypeError(
            f"this torch cannot store a {layout_name(dtype)} KV cache on {device}: {exc}; "
            "use --kv-cache-dtype int8 or auto"
        ) from exc
    assert torch.allclose(back.cpu(), probe.cpu(), rtol=0.07), (back, probe)


def is_quantized(dtype: torch.dtype) -> bool:
    return dtype in _QMAX


def row_width(head_dim: int, dtype: torch.dtype) -> int:
    """Elements of one head's row in a cache of ``dtype``: the values, then the scale's bytes."""
    return head_dim + SCALE_BYTES if is_quantized(dtype) else head_dim


def head_dim_of(kv_cache: torch.Tensor) -> int:
    """The head dimension of a cache shaped as ``paged_cache.kv_cache_shape`` makes it."""
    width = kv_cache.shape[-1]
    return width - SCALE_BYTES if is_quantized(kv_cache.dtype) else width


def layout_name(dtype: torch.dtype) -> str:
    """The cache dtype as the runner's ``kv_layout`` and log lines name it: the model dtype
    (``bfloat16``), or the quantized values and their scale (``int8+float16scales``)."""
    name = str(dtype).removeprefix("torch.")
    return f"{name}+float16scales" if is_quantized(dtype) else name


def quantize(kv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Rows ``[..., head_dim]`` as stored: ``[..., head_dim + SCALE_BYTES]`` of ``dtype``.

    Each row gets its own scale, amax / QMAX rounded to float16; the values are divided by
    the *rounded* scale, so that values times the stored scale is the dequantization."""
    x = kv.float()
    amax = x.abs().amax(dim=-1, keepdim=True)
    qmax = _QMAX[dtype]
    scale = (amax / qmax).clamp_(_MIN_SCALE, _MAX_SCALE).to(SCALE_DTYPE)
    values = x / scale.float()
    if dtype == torch.int8:
        values = values.round_().clamp_(-qmax, qmax)
    else:
        values = values.clamp_(-qmax, qmax)
    head_dim = kv.shape[-1]
    out = torch.empty((*kv.shape[:-1], head_dim + SCALE_BYTES), dtype=dtype, device=kv.device)
    out[..., :head_dim] = values.to(dtype)
    _scales(out).copy_(scale)
    return out


def dequantize(rows: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Stored rows ``[..., head_dim + SCALE_BYTES]`` as ``dtype`` values ``[..., head_dim]``.

    ``rows`` may be any strided view whose last axis is contiguous (a gather, a slice of the
    cache); the result is laid out as ``rows`` is, so a transposed view stays one."""
    values = rows[..., : rows.shape[-1] - SCALE_BYTES].to(dtype)
    return values.mul_(_scales(rows).to(dtype))


def _scales(rows: torch.Tensor) -> torch.Tensor:
    """The float16 scale of each row, ``[..., 1]``: a view of the rows' last two bytes."""
    head_dim = rows.shape[-1] - SCALE_BYTES
    return rows.view(torch.uint8)[..., head_dim:].view(SCALE_DTYPE)


def as_words(kv_cache: torch.Tensor, num_rows: int) -> torch.Tensor:
    """The (contiguous) cache as ``[num_rows, -1]`` of the widest integer a row divides into
    (rows of one token, or of one block): index_copy_ and index_select have no float8
    kernels on the CPU, and move wide elements faster than bytes anyway (on 4 KiB runs,
    bytes were about 8x slower than 16-byte elements: kv_transfer/blocks.py)."""
    flat = kv_cache.view(num_rows, -1).view(torch.uint8)
    for word in (torch.int64, torch.int32, torch.int16):
        if flat.shape[1] % word.itemsize == 0:
            return flat.view(word)
    return flat


def write_quantized(
    kv_cache: torch.Tensor, kv: torch.Tensor, slot_mapping: torch.Tensor
) -> torch.Tensor:
    """``paged_cache.write_kv`` into a quantized cache: quantize the step's rows, scatter them
    as integer words, and return what the cache now holds, dequantized to ``kv``'s dtype."""
    num_slots = kv_cache.shape[0] * kv_cache.shape[1]
    stored = quantize(kv, kv_cache.dtype)  # [num_tokens, 2, Hkv, head_dim + scale]
    as_words(kv_cache, num_slots).index_copy_(0, slot_mapping, as_words(stored, kv.shape[0]))
    return dequantize(stored, kv.dtype)


def gather_dequantized(
    kv_cache: torch.Tensor,
    block_ids: torch.Tensor,
    num_tokens: int,
    dtype: torch.dtype,
    first_block: int | None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``paged_cache.gather_kv`` of a quantized cache: the same whole-block copy (of the blocks'
    bytes, as integer words), then one dequantizing pass over the tokens used, which is the
    copy SDPA reads; consecutive blocks are dequantized straight from the cache. Returns K
    and V, ``[..., Hkv, num_tokens, head_dim]`` each."""
    num_blocks, block_size, _, num_kv_heads, width = kv_cache.shape
    lead = block_ids.shape[:-1]  # () or (B,)
    count = block_ids.shape[-1]
    if first_block is not None:
        rows = kv_cache[first_block : first_block + count]
    else:
        words = as_words(kv_cache, num_blocks).index_select(0, block_ids.reshape(-1))
        rows = words.view(torch.uint8).view(kv_cache.dtype)
    rows = rows.view(*lead, count * block_size, 2, num_kv_heads, width)
    kv = dequantize(rows.narrow(-4, 0, num_tokens), dtype)  # [..., tokens, 2, Hkv, D]
    kv = kv.movedim(-3, 0).transpose(-3, -2)  # [2, ..., Hkv, tokens, D]
    return kv[0], kv[1]
