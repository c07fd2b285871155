"""The pure engine loop: stop conditions, validation, aborts, and a randomized soak."""

import dataclasses
import random

import pytest
from testkit.fake_runner import FakeRunner

from kvflow.engine_worker.core.config import SchedulerConfig
from kvflow.engine_worker.core.engine import Engine, EngineConfig, RequestOutput
from kvflow.engine_worker.core.errors import DuplicateRequestError, InvalidRequestError
from kvflow.engine_worker.core.request import FinishReason
from kvflow.engine_worker.core.sampling_params import SamplingParams

BS = 4
VOCAB = 500
EOS = 3


def make_engine(
    *,
    budget: int = 32,
    num_blocks: int = 64,
    max_seqs: int = 16,
    max_len: int = 128,
    caching: bool = True,
) -> Engine:
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=budget,
            max_num_seqs=max_seqs,
            max_model_len=max_len,
            block_size=BS,
        ),
        num_kv_blocks=num_blocks,
        vocab_size=VOCAB,
        eos_token_ids=(EOS,),
        hash_seed=b"seed",
        enable_prefix_caching=caching,
    )
    return Engine(config, FakeRunner(block_size=BS, vocab_size=VOCAB))


def run_all(e: Engine, max_steps: int = 10_000) -> dict[str, tuple[list[int], RequestOutput]]:
    """Step until idle; returns each request's tokens and final output."""
    tokens: dict[str, list[int]] = {}
    final: dict[str, tuple[list[int], RequestOutput]] = {}
    for _ in range(max_steps):
        if not e.has_unfinished_requests:
            return final
        for out in e.step():
            tokens.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
            if out.finish_reason is not None:
                final[out.request_id] = (tokens.pop(out.request_id), out)
    raise AssertionError("engine did not finish")


def expected_tokens(prompt: list[int], n: int) -> list[int]:
    runner = FakeRunner(block_size=BS, vocab_size=VOCAB)
    seq = list(prompt)
    for _ in range(n):
        seq.append(runner.next_token(seq))
    return seq[len(prompt) :]


def test_outputs_do_not_depend_on_chunking_caching_or_preemption() -> None:
    prompts = [[(7 * i + j) % VOCAB for j in range(20 + 5 * i)] for i in range(6)]
    shared = prompts[0][:16]
    prompts += [shared + [400 + i] * (3 + i) for i in range(4)]  # prefix hits
    results = []
    for budget, blocks, caching in [(512, 256, False), (7, 256, True), (64, 24, True)]:
        e = make_engine(budget=budget, num_blocks=blocks, caching=caching)
        for i, p in enumerate(prompts):
            e.add_request(f"r{i}", p, SamplingParams(max_tokens=12, ignore_eos=True))
        results.append({rid: toks for rid, (toks, _) in run_all(e).items()})
    for i, p in enumerate(prompts):
        assert results[0][f"r{i}"] == expected_tokens(p, 12)
    assert results[0] == results[1] == results[2]


def test_prefix_hits_are_reported_as_cached_tokens() -> None:
    e = make_engine()
    e.add_request("a", list(range(30)), SamplingParams(max_tokens=1))
    run_all(e)
    e.add_request("b", list(range(30)) + [9, 9], SamplingParams(max_tokens=1))
    (_, out) = run_all(e)["b"]
    assert out.num_cached_tokens == 28 and out.num_prompt_tokens == 32


def test_stop_token_and_eos_end_the_request_without_being_emitted() -> None:
    prompt = [5, 6, 7, 8]
    first, second = expected_tokens(prompt, 2)
    e = make_engine()
    e.add_request("stop", prompt, SamplingParams(stop_token_ids=(second,)))
    toks, out = run_all(e)["stop"]
    assert toks == [first]
    assert out.finish_reason is FinishReason.STOP and out.stop_token_id == second
    assert out.num_output_tokens == 2


def test_eos_is_ignored_on_request() -> None:
    e = make_engine()
    e.config = dataclasses.replace(e.config, eos_token_ids=tuple(range(VOCAB)))
    e.add_request("eos", [1, 2], SamplingParams())
    e.add_request("ignore", [1, 2], SamplingParams(max_tokens=5, ignore_eos=True))
    final = run_all(e)
    assert final["eos"][1].finish_reason is FinishReason.STOP and final["eos"][0] == []
    assert final["ignore"][1].finish_reason is FinishReason.LENGTH and len(final["ignore"][0]) == 5


def test_context_length_ends_generation() -> None:
    e = make_engine(max_len=20)
    e.add_request("a", list(range(15)), SamplingParams(ignore_eos=True))
    toks, out = run_all(e)["a"]
    assert len(toks) == 5 and out.finish_reason is FinishReason.LENGTH


@pytest.mark.parametrize(
    ("prompt", "params", "message"),
    [
        ([], SamplingParams(), "prompt is empty"),
        ([1, VOCAB], SamplingParams(), "outside the vocabulary"),
        (list(range(128)), SamplingParams(), "shorten the prompt"),
        ([1], SamplingParams(max_tokens=-1), "max_tokens must be >= 1"),
        ([1], SamplingParams(temperature=-0.5), "temperature"),
        ([1], SamplingParams(top_p=0.0), "top_p"),
        ([1], SamplingParams(top_logprobs=21), "top_logprobs"),
        ([1], SamplingParams(stop_token_ids=(VOCAB + 1,)), "stop_token_ids"),
    ],
)
def test_bad_requests_are_rejected_and_the_engine_keeps_serving(
    prompt: list[int], params: SamplingParams, message: str
) -> None:
    e = make_engine()
    with pytest.raises(InvalidRequestError, match=message):
        e.add_request("bad", prompt, params)
    assert not e.has_unfinished_requests
    e.add_request("good", [1, 2, 3], SamplingParams(max_tokens=2, ignore_eos=True))
    assert len(run_all(e)["good"][0]) == 2


def test_duplicate_ids_are_rejected() -> None:
    e = make_engine()
    e.add_request("a", [1], SamplingParams(max_tokens=3))
    with pytest.raises(DuplicateRequestError):
        e.add_request("a", [1], SamplingParams())


def test_abort_frees_blocks_at_once() -> None:
    e = make_engine(budget=8)
    e.add_request("a", list(range(40)), SamplingParams(ignore_eos=True))
    e.step()
    assert e.kv_cache.pool.num_free_blocks < 64
    out = e.abort_request("a")
    assert out is not None and out.finish_reason is FinishReason.ABORT
    assert e.kv_cache.pool.num_free_blocks == 64
    assert e.abort_request("a") is None
    assert e.runner.released == ["a"]  # type: ignore[attr-defined]


def test_randomized_1000_requests_with_aborts_and_preemptions_free_every_block() -> None:
    rng = random.Random(1234)
    num_blocks = 48  # tight: forces preemptions
    e = make_engine(budget=48, num_blocks=num_blocks, max_seqs=12, max_len=96)
    shared = [rng.randrange(VOCAB) for _ in range(24)]
    submitted = finished = aborted = 0
    live: list[str] = []
    preemptions = 0
    expected: dict[str, tuple[list[int], int]] = {}
    got: dict[str, list[int]] = {}
    while submitted < 1000 or e.has_unfinished_requests:
        for _ in range(rng.randrange(0, 4)):
            if submitted == 1000:
                break
            head = shared[: rng.randrange(0, 25)] if rng.random() < 0.5 else []
            prompt = head + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 40))]
            max_tokens = rng.randrange(1, 30)
            rid = f"r{submitted}"
            e.add_request(
                rid,
                prompt,
                SamplingParams(max_tokens=max_tokens, ignore_eos=True),
                cache_salt=rng.choice(["", "t1", "t2"]),
                priority=rng.randrange(3),
            )
            expected[rid] = (prompt, max_tokens)
            live.append(rid)
            submitted += 1
        if live and rng.random() < 0.1:
            rid = live.pop(rng.randrange(len(live)))
            if e.abort_request(rid) is not None:
                aborted += 1
                got.pop(rid, None)
        for out in e.step():
            got.setdefault(out.request_id, []).extend(t.token_id for t in out.new_tokens)
            if out.finish_reason is not None:
                finished += 1
                live.remove(out.request_id)
                assert out.timings is not None
                preemptions += out.timings.num_preemptions
                prompt, max_tokens = expected[out.request_id]
                assert got.pop(out.request_id) == expected_tokens(prompt, max_tokens)
        pool = e.kv_cache.pool
        referenced = sum(b.ref_cnt for b in pool.blocks)
        held = sum(len(e.kv_cache.block_ids(r)) for r in e.requests)
        assert referenced == held, "a block reference leaked or was lost"
    assert finished + aborted == 1000 and aborted > 50 and preemptions > 20
    pool = e.kv_cache.pool
    assert pool.num_free_blocks == num_blocks
    assert all(b.ref_cnt == 0 for b in pool.blocks)
    assert e.kv_cache.stats.num_hit_tokens > 0
