"""Real worker processes for the PD tests: one tiny random Llama, written once."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.tiny_model import write_tiny_llama


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_llama(tmp_path_factory.mktemp("pd") / "tiny", seed=3)
