"""The per-request logits-processor hook: asked once per sampled step with the outputs so
far, its disallowed tokens never sampled (greedy or random), other rows untouched."""

from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from kvflow.engine_worker.core.sampling_params import SamplingParams
from kvflow.engine_worker.logits_processor import LogitsProcessor
from kvflow.engine_worker.sampler import Sampler

VOCAB = 40


@dataclass
class History:
    prompt_token_ids: list[int]
    token_ids: list[int]


@dataclass
class Allowed:
    """Allows a fixed set (or nothing past ``n``); records what it was asked."""

    token_ids: list[int]
    n: int = VOCAB
    calls: list[list[int]] = field(default_factory=list)

    def allowed_token_mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        self.calls.append(list(output_token_ids))
        mask = torch.zeros(self.n, dtype=torch.bool)
        mask[self.token_ids] = True
        return mask


class Unconstrained:
    def allowed_token_mask(self, output_token_ids: Sequence[int]) -> torch.Tensor | None:
        return None


def test_the_hook_is_a_protocol() -> None:
    assert isinstance(Allowed([1]), LogitsProcessor)
    assert isinstance(Unconstrained(), LogitsProcessor)


def test_only_allowed_tokens_are_sampled_greedy_and_random() -> None:
    sampler = Sampler()
    logits = torch.randn(4, VOCAB, generator=torch.Generator().manual_seed(0)) * 5
    procs = [Allowed([3, 7]), Allowed([11]), None, Allowed([5, 6, 30])]
    temps = [0.0, 1.0, 0.0, 1.5]
    params = [
        SamplingParams(temperature=t, logits_processor=p) for t, p in zip(temps, procs, strict=True)
    ]
    histories = [History([1, 2], [1, 2, 9, 8]), History([4], [4]), History([1], [1]),
                 History([2, 2], [2, 2, 0])]  # fmt: skip
    for _ in range(50):
        out = sampler.sample(logits, list("abcd"), params, histories=histories)
        assert out[0].token_id == max((3, 7), key=lambda t: float(logits[0, t]))
        assert out[1].token_id == 11
        assert out[2].token_id == int(logits[2].argmax())  # no processor: untouched
        assert out[3].token_id in (5, 6, 30)
    # Asked once per sampled step, with the outputs so far (prompt excluded).
    first = procs[0]
    assert isinstance(first, Allowed)
    assert first.calls == [[9, 8]] * 50
    assert procs[1].calls[0] == []  # type: ignore[union-attr]


def test_tokens_past_a_short_mask_are_disallowed_and_none_means_free() -> None:
    logits = torch.zeros(2, VOCAB)
    logits[:, VOCAB - 1] = 100.0  # the padded tail would win
    logits[:, 2] = 1.0
    params = [
        SamplingParams(temperature=0.0, logits_processor=Allowed([2], n=VOCAB - 4)),
        SamplingParams(temperature=0.0, logits_processor=Unconstrained()),
    ]
    out = Sampler().sample(logits, ["a", "b"], params, histories=[History([1], [1])] * 2)
    assert [t.token_id for t in out] == [2, VOCAB - 1]


def test_logprobs_stay_those_of_the_raw_distribution() -> None:
    logits = torch.randn(1, VOCAB, generator=torch.Generator().manual_seed(1))
    params = [SamplingParams(temperature=0.0, logprobs=True, logits_processor=Allowed([4]))]
    (out,) = Sampler().sample(logits, ["a"], params, histories=[History([1], [1])])
    assert out.token_id == 4
    assert out.logprob is not None
    assert abs(out.logprob - float(torch.log_softmax(logits[0], -1)[4])) < 1e-5


def test_the_processor_wins_over_min_tokens_when_it_allows_only_eos() -> None:
    eos = 5  # not 0: argmax of an all -inf row is 0
    logits = torch.randn(2, VOCAB, generator=torch.Generator().manual_seed(2))
    params = [
        SamplingParams(temperature=0.0, min_tokens=5, logits_processor=Allowed([eos])),
        SamplingParams(temperature=0.0, min_tokens=5, logits_processor=Allowed([eos, 9])),
    ]
    out = Sampler(eos_token_ids=[eos]).sample(
        logits, ["a", "b"], params, histories=[History([1], [1])] * 2
    )
    assert [t.token_id for t in out] == [eos, 9]
