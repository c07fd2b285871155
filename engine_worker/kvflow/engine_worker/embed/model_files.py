"""Where the default embedding model lives: WordLlama's l2_supercat, in a PyPI wheel.

The wheel ``wordllama`` (MIT) ships static token embeddings (32000 x 256, Matryoshka-trained
so the leading 64 and 128 dimensions are embeddings too) and their Hugging Face tokenizer.
As with the default generation model (model/default_model.py), the package is never
imported: its files are found through the distribution's metadata, and the forward pass is
ours (embed/model.py).
"""

from __future__ import annotations

import importlib.metadata
from dataclasses import dataclass
from pathlib import Path

from kvflow.engine_worker.model.errors import ModelLoadError

DEFAULT_EMBEDDING_MODEL = "wordllama-l2-supercat"
DISTRIBUTION = "wordllama"
# --no-deps: its declared dependencies (toml, pydantic, requests) serve its own loader and
# downloads, which kvflow does not use.
INSTALL_COMMAND = "pip install --no-deps wordllama==0.4.0.post1"


@dataclass(frozen=True)
class EmbeddingModelFiles:
    name: str  # the served name unless --served-model-name says otherwise
    weights: Path  # safetensors holding `tensor_key`: (vocab, dimensions)
    tokenizer: Path  # a Hugging Face tokenizers JSON
    tensor_key: str
    # Prefix lengths the model was trained to make embeddings of (Matryoshka), ascending;
    # the last is its full width.
    allowed_dimensions: tuple[int, ...]


_WORDLLAMA = {
    DEFAULT_EMBEDDING_MODEL: (
        "wordllama/weights/l2_supercat_256.safetensors",
        "wordllama/tokenizers/l2_supercat_tokenizer_config.json",
        (64, 128, 256),
    ),
}


def embedding_model_files(model: str | None) -> EmbeddingModelFiles:
    """The files of ``model`` (None: the default); ``ModelLoadError`` saying what to do."""
    name = model or DEFAULT_EMBEDDING_MODEL
    if name not in _WORDLLAMA:
        raise ModelLoadError(
            f"unknown embedding model {name!r}: --task embed serves {sorted(_WORDLLAMA)}"
        )
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as err:
        raise ModelLoadError(
            f"the embedding model {name} is not installed: run `{INSTALL_COMMAND}`"
        ) from err
    weights_file, tokenizer_file, dims = _WORDLLAMA[name]
    paths = [Path(str(distribution.locate_file(f))) for f in (weights_file, tokenizer_file)]
    for path in paths:
        if not path.is_file():
            raise ModelLoadError(
                f"{path} is missing although {DISTRIBUTION} is installed; reinstall it with "
                f"`{INSTALL_COMMAND} --force-reinstall`"
            )
    return EmbeddingModelFiles(name, paths[0], paths[1], "embedding.weight", dims)
