"""The sampler: greedy, filters, seeds reproducible regardless of batch, logprobs."""

import math
import warnings
from types import SimpleNamespace

import pytest
import torch

from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.sampler import Sampler

VOCAB = 50


def logits_rows(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn(n, VOCAB, generator=torch.Generator().manual_seed(seed)) * 3


def test_greedy_takes_the_argmax() -> None:
    logits = logits_rows(4)
    out = Sampler().sample(logits, list("abcd"), [SamplingParams(temperature=0.0)] * 4)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_greedy_takes_the_first_of_tied_logits() -> None:
    # As argmax does (and transformers' greedy search): ties go to the lowest token id, in
    # the all-greedy fast path and in the shaped path (a logit bias sends it there).
    logits = torch.zeros(3, VOCAB)
    logits[0, [7, 3, 40]] = 5.0
    logits[1, [49, 12]] = 1.0
    plain = Sampler().sample(logits, list("abc"), [SamplingParams(temperature=0.0)] * 3)
    assert [t.token_id for t in plain] == [3, 12, 0]
    biased = [SamplingParams(temperature=0.0, logit_bias=((49, 0.0),))] * 3
    histories = [SimpleNamespace(token_ids=[1], prompt_token_ids=[1])] * 3
    shaped = Sampler().sample(logits, list("abc"), biased, histories=histories)
    assert [t.token_id for t in shaped] == [3, 12, 0]


def test_top_k_1_is_greedy_even_with_temperature() -> None:
    logits = logits_rows(3)
    out = Sampler().sample(logits, list("abc"), [SamplingParams(temperature=2.0, top_k=1)] * 3)
    assert [t.token_id for t in out] == logits.argmax(-1).tolist()


def test_seeded_requests_repeat_whatever_the_batch() -> None:
    row = logits_rows(1, seed=5)
    params = SamplingParams(temperature=1.0, seed=42)
    alone = []
    s = Sampler()
    for _ in range(20):
        alone.append(s.sample(row, ["x"], [params])[0].token_id)
    batched = []
    s = Sampler(default_seed=99)
    for step in range(20):
        others = logits_rows(3, seed=100 + step)
        logits = torch.cat([others[:2], row, others[2:]])
        ids = ["o1", "o2", "x", "o3"]
        plist = [SamplingParams(temperature=1.0)] * 2 + [params] + [SamplingParams(top_p=0.5)]
        batched.append(s.sample(logits, ids, plist)[2].token_id)
    assert alone == batched
    assert len(set(alone)) > 1  # it really samples


def test_filters_restrict_the_support() -> None:
    logits = torch.zeros(1, VOCAB)
    logits[0, :5] = torch.tensor([5.0, 4.0, 3.0, 2.0, 1.0])
    s = Sampler()
    draws = {
        name: {s.sample(logits, ["r"], [p])[0].token_id for _ in range(300)}
        for name, p in {
            "top_k": SamplingParams(top_k=2),
            "top_p": SamplingParams(top_p=0.7),
            "min_p": SamplingParams(min_p=0.3),
        }.items()
    }
    assert draws["top_k"] == {0, 1}
    # softmax([5, 4, 3, 2, 1] + 45 zeros): p0=0.533, p1=0.196, p2=0.072: the head whose mass
    # reaches 0.7 is {0, 1}
    assert draws["top_p"] == {0, 1}
    # min_p 0.3 keeps tokens with p >= 0.3 * p0 = 0.16: tokens 0 and 1
    assert draws["min_p"] == {0, 1}


def test_temperature_sampling_follows_the_distribution() -> None:
    logits = torch.log(torch.tensor([[0.7, 0.2, 0.1]]))
    s = Sampler()
    counts = [0, 0, 0]
    for _ in range(3000):
        counts[s.sample(logits, ["r"], [SamplingParams()])[0].token_id] += 1
    assert abs(counts[0] / 3000 - 0.7) < 0.04 and abs(counts[2] / 3000 - 0.1) < 0.03


def test_logprobs_of_chosen_and_top_n() -> None:
    logits = logits_rows(3)
    params = [
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=3),
        SamplingParams(),
        SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2),
    ]
    out = Sampler().sample(logits, ["a", "b", "c"], params)
    for row, n in ((0, 3), (2, 2)):  # each row its own top n
        lp = torch.log_softmax(logits[row], -1)
        assert out[row].token_id == int(lp.argmax())
        assert math.isclose(out[row].logprob or 0.0, float(lp.max()), rel_tol=1e-6)
        assert out[row].top_token_ids == tuple(lp.topk(n).indices.tolist())
        assert out[row].top_logprobs == tuple(lp.topk(n).values.tolist())
    assert out[1].logprob is None and out[1].top_token_ids == ()


def test_an_all_greedy_batch_still_reports_logprobs_and_applies_bias() -> None:
    # All rows greedy takes the fast path only when no row shapes logits or wants logprobs.
    logits = logits_rows(2)
    histories = [SimpleNamespace(token_ids=[1], prompt_token_ids=[1])] * 2
    greedy = SamplingParams(temperature=0.0)
    with_logprobs = SamplingParams(temperature=0.0, logprobs=True, top_logprobs=2)
    out = Sampler().sample(logits, ["a", "b"], [with_logprobs, greedy], histories=histories)
    lp = torch.log_softmax(logits[0], -1)
    assert math.isclose(out[0].logprob or 0.0, float(lp.max()), rel_tol=1e-6)
    assert out[0].top_token_ids == tuple(lp.topk(2).indices.tolist())
    assert out[1].token_id == int(logits[1].argmax()) and out[1].logprob is None

    biased = int(logits[0].argmin())
    with_bias = SamplingParams(temperature=0.0, logit_bias=((biased, 100.0),))
    out = Sampler().sample(logits, ["a", "b"], [with_bias, greedy], histories=histories)
    assert out[0].token_id == biased


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU; not run here")
def test_a_mixed_batch_waits_for_the_gpu_only_to_copy_its_tokens_out() -> None:
    logits = logits_rows(4).cuda()
    params = [
        SamplingParams(temperature=0.0),
        SamplingParams(temperature=0.8, top_k=5, seed=1),
        SamplingParams(temperature=1.0, top_p=0.9, min_p=0.05),
        SamplingParams(temperature=0.7),
    ]
    sampler = Sampler("cuda")
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            out = sampler.sample(logits, ["a", "b", "c", "d"], params)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    syncs = [w for w in caught if "synchroniz" in str(w.message).lower()]
    assert len(syncs) == 1, [str(w.message) for w in syncs]  # the tokens' copy to the host
    assert out[0].token_id == int(logits[0].argmax())


def test_settings_that_overflow_the_logits_sample_one_row_never_fail_the_batch() -> None:
    """A temperature near 0 (1e-40: the logits divided by it overflow float32) samples
    greedily, and a repetition penalty near 0 (a seen token's logit divided by it is inf,
    the row's softmax NaN) takes the row's top token: before, the row's index was -1 and
    the gather failed the step, aborting every request on the worker."""
    logits = logits_rows(3)
    logits[1, 1] = 2.0  # a seen token with a positive logit: divided by 1e-40, inf
    histories = [SimpleNamespace(token_ids=[1], prompt_token_ids=[1])] * 3
    params = [SamplingParams(temperature=1e-40),
              SamplingParams(temperature=1.0, repetition_penalty=1e-40, seed=1),
              SamplingParams(temperature=1.0, seed=2)]  # fmt: skip
    assert params[0].is_greedy
    out = Sampler().sample(logits, list("abc"), params, histories=histories)
    assert out[0].token_id == int(logits[0].argmax())
    assert out[1].token_id == 1
    assert 0 <= out[2].token_id < VOCAB


def test_a_temperature_that_is_not_finite_is_refused() -> None:
    from kvflow.engine_worker.core.errors import InvalidRequestError

    for bad in (math.inf, math.nan, -1.0):
        with pytest.raises(InvalidRequestError, match="temperature"):
            SamplingParams(temperature=bad).validate(VOCAB)
