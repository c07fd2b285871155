"""Penalties, logit_bias and min_tokens in the batched sampler, against a per-request
reference written the plain way (loops over each request's tokens)."""

import dataclasses
import random
from collections import Counter
from dataclasses import dataclass

import pytest
import torch

from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.sampler import Sampler

VOCAB = 64
EOS = 7


@dataclass
class History:
    prompt_token_ids: list[int]
    token_ids: list[int]


def reference_logits(row: torch.Tensor, p: SamplingParams, h: History) -> torch.Tensor:
    """One request, step by step as the parameters are documented."""
    x = row.clone()
    outputs = h.token_ids[len(h.prompt_token_ids) :]
    r = torch.tensor(p.repetition_penalty)
    for t in set(h.prompt_token_ids) | set(outputs):
        x[t] = x[t] / r if x[t] > 0 else x[t] * r
    for t, count in Counter(outputs).items():
        x[t] = x[t] - torch.tensor(p.frequency_penalty) * count - torch.tensor(p.presence_penalty)
    for t, bias in p.logit_bias:
        x[t] = x[t] + bias
    if len(outputs) < p.min_tokens:
        for t in set(p.stop_token_ids) | (set() if p.ignore_eos else {EOS}):
            x[t] = float("-inf")
    return x


def without_shaping(p: SamplingParams) -> SamplingParams:
    return dataclasses.replace(
        p, presence_penalty=0.0, frequency_penalty=0.0, repetition_penalty=1.0,
        logit_bias=(), min_tokens=0,
    )  # fmt: skip


MIXED = [
    SamplingParams(temperature=0.0),
    SamplingParams(temperature=0.0, presence_penalty=1.5, frequency_penalty=0.7),
    SamplingParams(temperature=0.0, repetition_penalty=1.8),
    SamplingParams(temperature=0.0, repetition_penalty=0.6, frequency_penalty=-1.0),
    SamplingParams(temperature=0.9, seed=11, presence_penalty=2.0, repetition_penalty=1.3),
    SamplingParams(temperature=1.0, seed=12),
    SamplingParams(temperature=1.2, seed=13, frequency_penalty=2.0, logit_bias=((3, 4.0),)),
    SamplingParams(temperature=0.0, logit_bias=((5, -100.0), (9, 2.5)), min_tokens=4,
                   stop_token_ids=(9,)),
    SamplingParams(temperature=0.7, top_p=0.9, min_tokens=3, presence_penalty=-2.0),
    SamplingParams(temperature=1.0, frequency_penalty=1.0),  # unseeded: the shared generator
]  # fmt: skip


def test_mixed_batch_matches_the_reference_step_after_step() -> None:
    rng = random.Random(0)
    gen = torch.Generator().manual_seed(0)
    batched, plain = Sampler(eos_token_ids=[EOS]), Sampler(eos_token_ids=[EOS])
    ids = [f"r{i}" for i in range(len(MIXED))]
    params = list(MIXED)
    histories = []
    for _ in MIXED:
        prompt = [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))]
        histories.append(History(prompt, list(prompt)))
    num_changed = 0  # greedy rows whose choice the shaping changed
    for step in range(24):
        if step == 12:  # a request leaves and another takes its slot: no stale counts
            batched.release(ids[1])
            plain.release(ids[1])
            ids[1] = "new"
            histories[1] = History([4, 4, 5], [4, 4, 5])
        # Logits that keep repeating a few tokens make the penalties matter.
        logits = torch.randn(len(params), VOCAB, generator=gen) * 2
        logits[:, :10] += 3
        out = batched.sample(logits, ids, params, histories=histories)
        expected_logits = torch.stack(
            [reference_logits(logits[i], p, histories[i]) for i, p in enumerate(params)]
        )
        expected = plain.sample(expected_logits, ids, [without_shaping(p) for p in params])
        assert [t.token_id for t in out] == [t.token_id for t in expected], f"step {step}"
        num_changed += sum(out[i].token_id != int(logits[i].argmax()) for i in (1, 2, 3, 7))
        for h, t in zip(histories, out, strict=True):
            h.token_ids.append(t.token_id)
    assert num_changed > 10


def test_penalties_apply_to_greedy_rows_and_leave_others_alone() -> None:
    logits = torch.zeros(3, VOCAB)
    logits[:, 2] = 1.0
    logits[:, 3] = 0.9
    h = History([1], [1, 2, 2])  # token 2 generated twice
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.0, presence_penalty=0.2),
        SamplingParams(temperature=0.0, frequency_penalty=0.04),
    ]
    out = Sampler().sample(logits, ["a", "b", "c"], params, histories=[h] * 3)
    # 1.0 - 0.2 < 0.9; 1.0 - 2 * 0.04 = 0.92 > 0.9.
    assert [t.token_id for t in out] == [2, 3, 2]


def test_repetition_penalty_counts_the_prompt_and_divides_or_multiplies() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[0, 2], logits[0, 3] = 2.0, 1.5  # 2 in the prompt: 2 / 1.5 = 1.33 < 1.5
    logits[1, 2], logits[1, 3] = -1.0, -1.2  # 2 in the prompt: -1 * 1.5 = -1.5 < -1.2
    logits[1, 4:] = -5.0
    logits[1, :2] = -5.0
    p = SamplingParams(temperature=0.0, repetition_penalty=1.5)
    hist = History([2, 2], [2, 2])
    out = Sampler().sample(logits, ["a", "b"], [p, p], histories=[hist, hist])
    assert [t.token_id for t in out] == [3, 3]


def test_logit_bias_forces_or_bans_a_token() -> None:
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(3))
    top = logits.argmax(-1)
    params = [
        SamplingParams(temperature=0.0, logit_bias=((42, 100.0),)),
        SamplingParams(temperature=1.0, seed=1, logit_bias=((42, 100.0),)),
        SamplingParams(temperature=0.0, logit_bias=((int(top[2]), -100.0),)),
        SamplingParams(temperature=0.0),
    ]
    h = History([1], [1])
    sampler = Sampler()
    for _ in range(20):
        out = sampler.sample(logits, list("abcd"), params, histories=[h] * 4)
        assert out[0].token_id == 42 and out[1].token_id == 42
        assert out[2].token_id != int(top[2])
        assert out[3].token_id == int(top[3])


def test_min_tokens_masks_eos_and_stop_tokens_until_n_then_allows_them() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, EOS] = 50.0
    logits[0, 9] = 40.0  # a stop token, next favourite
    logits[0, 20] = 30.0
    p = SamplingParams(temperature=0.0, min_tokens=3, stop_token_ids=(9,))
    sampler = Sampler(eos_token_ids=[EOS])
    h = History([1], [1])
    chosen = []
    for _ in range(4):
        (t,) = sampler.sample(logits, ["a"], [p], histories=[h])
        chosen.append(t.token_id)
        h.token_ids.append(t.token_id)
    assert chosen == [20, 20, 20, EOS]
    # ignore_eos: EOS is no stop token, so min_tokens does not mask it.
    q = dataclasses.replace(p, ignore_eos=True)
    (t,) = sampler.sample(logits, ["b"], [q], histories=[History([1], [1])])
    assert t.token_id == EOS


def test_shaping_needs_the_histories() -> None:
    with pytest.raises(AssertionError, match="histories"):
        Sampler().sample(torch.zeros(1, VOCAB), ["a"], [SamplingParams(presence_penalty=1.0)])


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"presence_penalty": 2.5}, "presence_penalty must be in \\[-2, 2\\]"),
        ({"frequency_penalty": -2.01}, "frequency_penalty must be in \\[-2, 2\\]"),
        ({"frequency_penalty": float("nan")}, "frequency_penalty"),
        ({"repetition_penalty": 0.0}, "repetition_penalty must be > 0"),
        ({"repetition_penalty": float("inf")}, "repetition_penalty must be > 0"),
        ({"logit_bias": ((VOCAB, 1.0),)}, f"logit_bias token ids must be in \\[0, {VOCAB}\\)"),
        ({"logit_bias": ((1, 101.0),)}, "logit_bias values must be in \\[-100, 100\\]"),
        ({"logit_bias": ((1, 1.0), (1, 2.0))}, "twice"),
        ({"logit_bias": tuple((i, 1.0) for i in range(301))}, "at most 300"),
        ({"min_tokens": -1}, "min_tokens must be >= 0"),
        ({"min_tokens": 5, "max_tokens": 4}, "min_tokens \\(5\\) must be <= max_tokens \\(4\\)"),
    ],
)
def test_bad_values_are_refused_by_name(kwargs: dict, message: str) -> None:
    vocab = 400 if "logit_bias" in kwargs and len(kwargs["logit_bias"]) > 2 else VOCAB
    with pytest.raises(InvalidRequestError, match=message):
        SamplingParams(**kwargs).validate(vocab)
