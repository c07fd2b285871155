"""A real torch worker (a tiny random Llama with SmolLM2's tokenizer) behind a real gateway.

Random weights under a grammar still write text in the format: the masks, not the model,
make it valid, which is exactly what these tests check. Schemas bound their strings and
numbers (maxLength, enums, ranges) so that a random model finishes in a few dozen tokens.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.tiny_model import write_tiny_llama
from testkit.tokenizer_files import write_smollm2_tokenizer
from testkit.worker_process import WorkerProcess, launch_worker

MODEL = "tiny"


@pytest.fixture(scope="session")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_llama(tmp_path_factory.mktemp("structured") / "model", seed=1)
    return write_smollm2_tokenizer(folder)


@pytest.fixture(scope="session")
def tiny_worker(tiny_dir: Path) -> Iterator[WorkerProcess]:
    w = launch_worker(["--model", str(tiny_dir), "--served-model-name", MODEL,
                       "--num-kv-blocks", "512"], timeout_s=300)  # fmt: skip
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="session")
def tiny_gateway(tiny_worker: WorkerProcess, tiny_dir: Path) -> Iterator[GatewayProcess]:
    g = launch_gateway(["--model", str(tiny_dir), "--served-model-name", MODEL,
                        "--workers", tiny_worker.address])  # fmt: skip
    try:
        g.wait_ready()
        yield g
    finally:
        g.stop()


@pytest.fixture
def client(tiny_gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=tiny_gateway.base_url, api_key="x", max_retries=0, timeout=120)
