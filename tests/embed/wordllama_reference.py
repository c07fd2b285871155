"""WordLlama's own inference, as the reference our embedding worker must equal.

wordllama reads its training configs with the `toml` package at import, which kvflow does
not install (it installs the wheel with --no-deps); Python's tomllib reads the same files,
so it stands in when toml is absent. The tokenizer is looked up under `<cache_dir>/
tokenizers/` (its package-root lookup spells the folder `tokenizer`), so the package
folder is passed as the cache: everything is read from the installed wheel, nothing fetched.
"""

from __future__ import annotations

import importlib.util
import sys
import tomllib
import types
from pathlib import Path
from typing import Any


def _toml_from_tomllib() -> None:
    if "toml" in sys.modules or importlib.util.find_spec("toml") is not None:
        return
    shim = types.ModuleType("toml")
    shim.load = lambda path: tomllib.loads(Path(path).read_text())  # type: ignore[attr-defined]
    sys.modules["toml"] = shim


def load_wordllama(trunc_dim: int | None = None) -> Any:
    """``WordLlama.load("l2_supercat", dim=256, trunc_dim=...)`` from the installed wheel."""
    _toml_from_tomllib()
    import wordllama

    package = Path(wordllama.__file__).parent
    return wordllama.WordLlama.load(
        "l2_supercat", dim=256, trunc_dim=trunc_dim, cache_dir=package, disable_download=True
    )
