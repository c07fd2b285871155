"""End to end with a real torch worker: a tiny random Llama paired with SmolLM2's tokenizer.

The gateway's greedy text must equal what transformers generates from the same weights
and the same chat template, and logprobs must come back in OpenAI's shape.
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.tiny_model import write_tiny_llama
from testkit.tokenizer_files import write_smollm2_tokenizer
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"
MESSAGES = [{"role": "user", "content": "Write a haiku about the sea."}]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_tiny_llama(tmp_path_factory.mktemp("tiny") / "model", seed=0)
    return write_smollm2_tokenizer(folder)


@pytest.fixture(scope="module")
def worker(model_dir: Path) -> Iterator[WorkerProcess]:
    w = launch_worker(["--model", str(model_dir), "--served-model-name", MODEL,
                       "--num-kv-blocks", "256"], timeout_s=300)  # fmt: skip
    yield w
    w.stop(timeout_s=10)


@pytest.fixture(scope="module")
def gateway(worker: WorkerProcess, model_dir: Path) -> Iterator[GatewayProcess]:
    g = launch_gateway(["--model", str(model_dir), "--served-model-name", MODEL,
                        "--workers", worker.address])  # fmt: skip
    try:
        g.wait_ready()
        yield g
    finally:
        g.stop()


@pytest.fixture
def client(gateway: GatewayProcess) -> openai.OpenAI:
    return openai.OpenAI(base_url=gateway.base_url, api_key="x", max_retries=0, timeout=120)


def test_greedy_text_matches_transformers(client: openai.OpenAI, model_dir: Path) -> None:
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))
    prompt_ids = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True,
                                               return_tensors="pt", return_dict=True)  # fmt: skip
    with torch.no_grad():
        out = model.generate(**prompt_ids, max_new_tokens=12, do_sample=False,
                             eos_token_id=None, pad_token_id=2)  # fmt: skip
    expected = tokenizer.decode(out[0, prompt_ids["input_ids"].shape[1]:],
                                skip_special_tokens=True)  # fmt: skip
    no_eos = {"ignore_eos": True}
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=12, temperature=0, extra_body=no_eos
    )
    assert response.choices[0].message.content == expected
    assert response.usage is not None
    assert response.usage.prompt_tokens == prompt_ids["input_ids"].shape[1]
    streamed = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=12,
                                              temperature=0, stream=True,
                                              extra_body={"ignore_eos": True})  # fmt: skip
    assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == expected


def test_logprobs_in_openai_shape(client: openai.OpenAI) -> None:
    response = client.chat.completions.create(
        model=MODEL, messages=MESSAGES, max_tokens=5, temperature=0, logprobs=True,
        top_logprobs=3, extra_body={"ignore_eos": True},
    )  # fmt: skip
    content = response.choices[0].logprobs.content  # type: ignore[union-attr]
    assert content is not None and len(content) == 5
    for item in content:
        assert item.logprob <= 0 and not math.isnan(item.logprob)
        assert len(item.top_logprobs) == 3
        # Greedy: the chosen token is the most likely one.
        assert item.top_logprobs[0].token == item.token
        assert item.top_logprobs[0].logprob == pytest.approx(item.logprob, abs=1e-4)
        assert bytes(item.bytes or []).decode("utf-8", errors="replace") == item.token
    assert "".join(item.token for item in content) == response.choices[0].message.content
    legacy = client.completions.create(model=MODEL, prompt="The sea is", max_tokens=4,
                                       temperature=0, logprobs=2,
                                       extra_body={"ignore_eos": True})  # fmt: skip
    lp = legacy.choices[0].logprobs
    assert lp is not None and lp.tokens is not None and len(lp.tokens) == 4
    assert lp.text_offset == [sum(len(t) for t in lp.tokens[:i]) for i in range(4)]
    assert all(len(top) <= 2 for top in lp.top_logprobs or [])


def test_seeded_sampling_is_reproducible(client: openai.OpenAI) -> None:
    def sample() -> list[str]:
        r = client.chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=8,
                                           temperature=1.0, seed=42, n=2,
                                           extra_body={"ignore_eos": True})  # fmt: skip
        return [c.message.content or "" for c in r.choices]

    first, second = sample(), sample()
    assert first == second
    assert first[0] != first[1]  # n choices get different seeds
