"""Quantized weights kept quantized: GGUF blocks as 4-bit planes for torch's int4 kernels."""
