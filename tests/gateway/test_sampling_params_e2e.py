"""Penalties, logit_bias and min_tokens end to end: the official `openai` client, a real
gateway and a real torch worker (a tiny random Llama with SmolLM2's tokenizer).

Greedy outputs under penalties must equal transformers' greedy generation from the same
weights with the penalties applied by plain reference processors (HF's own repetition
penalty; OpenAI's presence/frequency written out below).
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import openai
import pytest
from testkit.gateway_process import GatewayProcess, launch_gateway
from testkit.tiny_model import write_tiny_llama
from testkit.tokenizer_files import write_smollm2_tokenizer
from testkit.worker_process import WorkerProcess, launch_worker

pytestmark = [pytest.mark.integration, pytest.mark.slow]

MODEL = "tiny"
EOS = 2  # the tiny model's EOS (SmolLM2's <|im_end|>)
PROMPT = [504, 3458, 282, 253, 5281, 30, 378, 3458, 282]  # token ids: no template involved
NUM_TOKENS = 16


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


@pytest.fixture(scope="module")
def hf(model_dir: Path) -> Any:
    """transformers' model and tokenizer over the same files, and a greedy generator."""
    transformers = pytest.importorskip("transformers")
    torch = pytest.importorskip("torch")
    tokenizer = transformers.AutoTokenizer.from_pretrained(str(model_dir))
    model = transformers.AutoModelForCausalLM.from_pretrained(str(model_dir))

    class OpenAIPenalties(transformers.LogitsProcessor):
        """Presence and frequency over the generated tokens only, one request, plainly."""

        def __init__(self, presence: float, frequency: float) -> None:
            self.presence, self.frequency = presence, frequency

        def __call__(self, input_ids: Any, scores: Any) -> Any:
            for t, count in Counter(input_ids[0, len(PROMPT) :].tolist()).items():
                scores[0, t] -= self.frequency * count + self.presence
            return scores

    def generate(*, presence: float = 0.0, frequency: float = 0.0, repetition: float = 1.0) -> str:
        processors = transformers.LogitsProcessorList([OpenAIPenalties(presence, frequency)])
        with torch.no_grad():
            out = model.generate(torch.tensor([PROMPT]), max_new_tokens=NUM_TOKENS,
                                 do_sample=False, repetition_penalty=repetition,
                                 logits_processor=processors, eos_token_id=None,
                                 pad_token_id=EOS)  # fmt: skip
        return str(tokenizer.decode(out[0, len(PROMPT) :], skip_special_tokens=True))

    return tokenizer, generate


def complete(client: openai.OpenAI, **kwargs: Any) -> Any:
    extra = {"ignore_eos": True, **kwargs.pop("extra_body", {})}
    args = {"max_tokens": NUM_TOKENS, "temperature": 0, **kwargs}
    return client.completions.create(model=MODEL, prompt=PROMPT, extra_body=extra, **args)


@pytest.mark.parametrize(
    ("api", "reference"),
    [
        ({"frequency_penalty": 2.0}, {"frequency": 2.0}),
        ({"presence_penalty": 1.5, "frequency_penalty": 0.5}, {"presence": 1.5, "frequency": 0.5}),
        ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition": 1.8}),
        ({"presence_penalty": -2.0}, {"presence": -2.0}),
    ],
)
def test_greedy_penalties_equal_the_reference(
    client: openai.OpenAI, hf: Any, api: dict[str, Any], reference: dict[str, float]
) -> None:
    _, generate = hf
    plain = complete(client).choices[0].text
    assert plain == generate()
    penalized = complete(client, **api).choices[0].text
    assert penalized == generate(**reference)
    assert penalized != plain  # the penalty changed the output


def test_logit_bias_forces_and_bans_tokens(client: openai.OpenAI, hf: Any) -> None:
    tokenizer, _ = hf
    forced = 28120
    expected = tokenizer.decode([forced] * 5)
    for sampling in ({"temperature": 0}, {"temperature": 1.0, "seed": 7}):
        r = complete(client, max_tokens=5, logit_bias={str(forced): 100}, **sampling)
        assert r.choices[0].text == expected
    first = tokenizer.encode(complete(client, max_tokens=1).choices[0].text)
    banned = complete(client, max_tokens=1, logit_bias={str(first[0]): -100}).choices[0].text
    assert banned and tokenizer.encode(banned) != first


def test_min_tokens_holds_eos_back_then_lets_it_stop(client: openai.OpenAI) -> None:
    eos_first = {"logit_bias": {str(EOS): 100}, "max_tokens": 12}
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0, **eos_first)
    assert (r.choices[0].text, r.choices[0].finish_reason) == ("", "stop")
    r = client.completions.create(model=MODEL, prompt=PROMPT, temperature=0,
                                  extra_body={"min_tokens": 5, "skip_special_tokens": False},
                                  **eos_first)  # fmt: skip
    # Masked, not ignored: five tokens that are not EOS, then EOS (not in the text).
    assert r.choices[0].finish_reason == "stop"
    assert r.choices[0].text and "<|im_end|>" not in r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 6  # 5 tokens, then EOS
    chat = client.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "hi"}], max_tokens=12,
        logit_bias={str(EOS): 100}, extra_body={"min_tokens": 3},
    )  # fmt: skip
    assert chat.usage is not None and chat.usage.completion_tokens == 4


@pytest.mark.parametrize(
    ("kwargs", "param"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty"),
        ({"frequency_penalty": -3}, "frequency_penalty"),
        ({"extra_body": {"repetition_penalty": 0}}, "repetition_penalty"),
        ({"logit_bias": {"49152": 1}}, "logit_bias"),  # the vocabulary is 49,152 tokens
        ({"logit_bias": {"5": 150}}, "logit_bias"),
        ({"logit_bias": {"x": 1}}, "logit_bias"),
        ({"extra_body": {"min_tokens": 20}}, "min_tokens"),  # max_tokens is 16
    ],
)
def test_bad_values_are_400s_naming_the_parameter(
    client: openai.OpenAI, kwargs: dict[str, Any], param: str
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        complete(client, **kwargs)
    assert info.value.status_code == 400
    body = info.value.body
    assert isinstance(body, dict) and body.get("param") == param, body
