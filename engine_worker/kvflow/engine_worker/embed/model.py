"""A static embedding model's forward pass: token vectors looked up, averaged, normalized.

This is WordLlama's inference (wordllama/inference.py, `embed(texts, norm=True)`) in torch:
texts tokenized without special tokens and without truncation; each text's token vectors
averaged (its attention mask, so padding never counts); the average divided by its L2 norm.
A request for fewer dimensions keeps that many leading columns before normalizing, as
WordLlama's `trunc_dim` does; averaging acts on each column alone, so the columns are cut
after the average here, which gives the same numbers.

One `embedding_bag` call sums every input of a batch: each input's sum is computed from its
own tokens only, in order, so an input's vector does not depend on what it is batched with.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

import torch
from safetensors.torch import load_file
from tokenizers import Tokenizer

from kvflow.engine_worker.embed.model_files import EmbeddingModelFiles
from kvflow.engine_worker.model.errors import ModelLoadError


@dataclass
class StaticEmbedder:
    name: str
    weight: torch.Tensor  # (vocab, dimensions), float32, on the serving device
    tokenizer: Tokenizer
    allowed_dimensions: tuple[int, ...]

    @classmethod
    def load(cls, files: EmbeddingModelFiles, device: str = "cpu") -> StaticEmbedder:
        tensors = load_file(str(files.weights))
        if files.tensor_key not in tensors:
            raise ModelLoadError(f"{files.weights} holds no tensor {files.tensor_key!r}")
        weight = tensors[files.tensor_key].to(device=device, dtype=torch.float32).contiguous()
        tokenizer = Tokenizer.from_file(str(files.tokenizer))
        tokenizer.no_truncation()
        tokenizer.no_padding()
        return cls(files.name, weight, tokenizer, files.allowed_dimensions)

    @property
    def dimensions(self) -> int:
        return int(self.weight.shape[1])

    @property
    def vocab_size(self) -> int:
        return int(self.weight.shape[0])

    def tokenize(self, texts: Sequence[str]) -> list[list[int]]:
        encodings = self.tokenizer.encode_batch(list(texts), add_special_tokens=False)
        return [e.ids for e in encodings]

    @torch.inference_mode()
    def embed(self, token_ids: Sequence[Sequence[int]], dimensions: int) -> torch.Tensor:
        """(len(token_ids), dimensions) float32 on the CPU, each row of unit length. Every
        input must hold at least one token id below vocab_size (the service checks)."""
        device = self.weight.device
        lengths = torch.tensor([len(ids) for ids in token_ids], dtype=torch.int64)
        flat = torch.tensor([t for ids in token_ids for t in ids], dtype=torch.int64)
        offsets = torch.zeros_like(lengths)
        torch.cumsum(lengths[:-1], dim=0, out=offsets[1:])
        sums = torch.nn.functional.embedding_bag(
            flat.to(device), self.weight, offsets.to(device), mode="sum"
        )
        means = sums[:, :dimensions] / lengths.to(device, torch.float32).clamp(min=1)[:, None]
        norms: torch.Tensor = torch.linalg.vector_norm(means, dim=1, keepdim=True)
        return (means / norms).cpu()
