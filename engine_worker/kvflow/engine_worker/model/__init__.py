"""Llama-family models that read and write a paged KV cache."""
