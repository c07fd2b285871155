"""Defaults that protect the service, end to end: the official `openai` client, a real
gateway process, and a scripted worker that records exactly what reaches it.

The gateway serves a model folder whose generation_config.json holds sampling defaults,
with a max_tokens default and cap for the model, and tenants with their own cap and a
per-minute token limit.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from pathlib import Path

import openai
import pytest
import yaml
from testkit.fake_worker import FakeWorker, running_fake_worker
from testkit.gateway_process import GatewayProcess, running_gateway
from testkit.tokenizer_files import write_smollm2_tokenizer

from kvflow.router.api.gateway import build_gateway
from kvflow.router.settings import RouterSettings, parse_config
from kvflow.router.tenants.config import hash_api_key
from kvflow.router.text.generation_config import SamplingDefaults
from kvflow.router.text.model_files import load_text_model

pytestmark = pytest.mark.integration

TOKENS = load_text_model(None).tokenizer.encode(" The sea is wide", add_special_tokens=False)
MESSAGES = [{"role": "user", "content": "Tell me about the sea."}]
GENERATION_CONFIG = {"bos_token_id": 1, "eos_token_id": 2, "temperature": 0.3, "top_p": 0.8,
                     "top_k": 30}  # fmt: skip
TENANTS = {
    "plain": {},
    "capped": {"max_tokens_limit": 32},
    "small": {"tokens_per_minute": 300},
    "shrink": {"tokens_per_minute": 300},
}


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = write_smollm2_tokenizer(tmp_path_factory.mktemp("model"))
    (folder / "generation_config.json").write_text(json.dumps(GENERATION_CONFIG))
    return folder


@pytest.fixture(scope="module")
def worker() -> Iterator[tuple[FakeWorker, str]]:
    fake = FakeWorker(tokens=TOKENS)
    with running_fake_worker(fake) as address:
        yield fake, address


@pytest.fixture(scope="module")
def gateway(
    tmp_path_factory: pytest.TempPathFactory, model_dir: Path, worker: tuple[FakeWorker, str]
) -> Iterator[GatewayProcess]:
    config = {
        "limits": {"default_max_tokens": 64, "max_tokens_limit": 256},
        "tenants": [{"name": name, "api_key_sha256": hash_api_key(f"sk-{name}"), **limits}
                    for name, limits in TENANTS.items()],
    }  # fmt: skip
    path = tmp_path_factory.mktemp("router") / "router.yaml"
    path.write_text(yaml.safe_dump(config))
    with running_gateway(["--model", str(model_dir), "--workers", worker[1],
                          "--config", str(path)]) as g:  # fmt: skip
        g.wait_ready()
        yield g


def client(g: GatewayProcess, tenant: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=g.base_url, api_key=f"sk-{tenant}", max_retries=0, timeout=30)


def test_absent_fields_get_the_models_defaults_and_explicit_ones_win(
    gateway: GatewayProcess, worker: tuple[FakeWorker, str]
) -> None:
    fake, _ = worker
    plain = client(gateway, "plain")
    plain.chat.completions.create(model="fake", messages=MESSAGES)
    s = fake.requests[-1].sampling
    assert (round(s.temperature, 6), round(s.top_p, 6), s.top_k, s.max_tokens) == (0.3, 0.8, 30, 64)
    plain.chat.completions.create(model="fake", messages=MESSAGES, temperature=1.0, top_p=1.0,
                                  max_tokens=100, extra_body={"top_k": 0})  # fmt: skip
    s = fake.requests[-1].sampling
    assert (s.temperature, s.top_p, s.top_k, s.max_tokens) == (1.0, 1.0, 0, 100)


def test_max_tokens_over_the_limit_is_a_400_naming_it(
    gateway: GatewayProcess, worker: tuple[FakeWorker, str]
) -> None:
    with pytest.raises(openai.BadRequestError) as info:
        client(gateway, "plain").chat.completions.create(
            model="fake", messages=MESSAGES, max_tokens=257
        )
    body = info.value.response.json()["error"]
    assert (body["param"], body["code"]) == ("max_tokens", "invalid_value")
    assert "limit of 256 tokens set for model 'fake'" in body["message"]
    capped = client(gateway, "capped")
    with pytest.raises(openai.BadRequestError, match="limit of 32 tokens set for tenant 'capped'"):
        capped.completions.create(model="fake", prompt="hi", max_tokens=33)
    # The tenant's cap also cuts the model's default (64).
    capped.chat.completions.create(model="fake", messages=MESSAGES)
    assert worker[0].requests[-1].sampling.max_tokens == 32


def test_null_content_is_a_400_unless_an_assistant_calls_tools(gateway: GatewayProcess) -> None:
    plain = client(gateway, "plain")
    messages = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": None},
                {"role": "user", "content": "and?"}]  # fmt: skip
    with pytest.raises(openai.BadRequestError) as info:
        plain.chat.completions.create(model="fake", messages=messages)  # type: ignore[arg-type]
    assert info.value.response.json()["error"]["param"] == "messages[1].content"
    call = {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    messages[1] = {"role": "assistant", "content": None, "tool_calls": [call]}
    messages[2] = {"role": "tool", "tool_call_id": "c1", "content": "42"}
    r = plain.chat.completions.create(model="fake", messages=messages)  # type: ignore[arg-type]
    assert r.choices[0].message.content


def test_prompt_arrays_and_n_are_bounded_by_tokens_per_minute(
    gateway: GatewayProcess, worker: tuple[FakeWorker, str]
) -> None:
    fake, _ = worker
    small = client(gateway, "small")
    # 3 prompts x (1 + 100) can never fit 300 tokens a minute: 400, not a retry loop.
    with pytest.raises(openai.BadRequestError) as info:
        small.completions.create(model="fake", prompt=["a", "b", "c"], max_tokens=100)
    body = info.value.response.json()["error"]
    assert (body["param"], body["code"]) == ("max_tokens", "tokens_per_minute_exceeded")
    assert "limit 300, requested 303" in body["message"]
    with pytest.raises(openai.BadRequestError, match="limit 300") as info:
        small.chat.completions.create(model="fake", messages=MESSAGES, n=3, max_tokens=100)
    assert info.value.response.json()["error"]["param"] == "n"
    # 2 x 100 + the prompt fits; a second while the first holds its reservation is a 429
    # with Retry-After; the unused reservation comes back at the end.
    fake.token_delay_s = 0.3
    try:
        stream = small.chat.completions.create(model="fake", messages=MESSAGES, n=2,
                                               max_tokens=100, stream=True)  # fmt: skip
        next(iter(stream))
        with pytest.raises(openai.RateLimitError) as limited:
            small.chat.completions.create(model="fake", messages=MESSAGES, n=2, max_tokens=100)
        assert 1 <= int(limited.value.response.headers["retry-after"]) <= 60
        assert limited.value.response.json()["error"]["type"] == "tokens"
        for _ in stream:
            pass
    finally:
        fake.token_delay_s = 0.0
    # The first one's unused 190 tokens came back (settled just after its last chunk).
    for _ in range(20):
        try:
            r = small.chat.completions.create(model="fake", messages=MESSAGES, n=2, max_tokens=100)
            break
        except openai.RateLimitError:
            time.sleep(0.1)
    assert r.usage is not None and r.usage.completion_tokens == 2 * len(TOKENS)
    # Without max_tokens the default (64) is cut to what a minute holds, (300 - prompt) / 8.
    r = client(gateway, "shrink").chat.completions.create(model="fake", messages=MESSAGES, n=8)
    budget = (300 - r.usage.prompt_tokens) // 8 if r.usage else 0
    assert len(r.choices) == 8 and fake.requests[-1].sampling.max_tokens == budget < 64


def test_generation_config_none_turns_the_models_defaults_off(model_dir: Path) -> None:
    on = build_gateway(RouterSettings(model=str(model_dir)))
    assert on.backends[0].sampling_defaults == SamplingDefaults(
        temperature=0.3, top_p=0.8, top_k=30
    )
    config = parse_config({"sampling": {"generation_config": "none",
                                        "defaults": {"top_p": 0.5}}})  # fmt: skip
    off = build_gateway(RouterSettings(model=str(model_dir), config=config))
    assert off.backends[0].sampling_defaults == SamplingDefaults(top_p=0.5)


def test_each_pool_takes_its_own_models_defaults(
    tmp_path: Path, model_dir: Path, worker: tuple[FakeWorker, str]
) -> None:
    """Two pools behind one gateway: one with the folder's generation_config.json, one with
    the built-in SmolLM2 (its model card's temperature 0.2, top_p 0.9)."""
    fake_a, address_a = worker
    fake_b = FakeWorker(model="fake-b", tokens=TOKENS)
    config = tmp_path / "router.yaml"
    with running_fake_worker(fake_b) as address_b:
        config.write_text(yaml.safe_dump({"pools": [
            {"name": "a", "model": str(model_dir), "workers": [address_a]},
            {"name": "b", "workers": [address_b]},
        ]}))  # fmt: skip
        with running_gateway(["--config", str(config)]) as g:
            g.wait_ready(num_workers=2)
            c = openai.OpenAI(base_url=g.base_url, api_key="x", max_retries=0)
            assert c.chat.completions.create(model="fake", messages=MESSAGES).model == "fake"
            assert c.chat.completions.create(model="fake-b", messages=MESSAGES).model == "fake-b"
    a, b = fake_a.requests[-1].sampling, fake_b.requests[-1].sampling
    assert (a.temperature, a.top_p, a.top_k) == pytest.approx((0.3, 0.8, 30))
    assert (b.temperature, b.top_p) == pytest.approx((0.2, 0.9))
