"""Workloads are seeded and pure, and share exactly the text they claim to share."""

from __future__ import annotations

import itertools
import json

import pytest

from kvflow.loadgen.multi_turn import MultiTurnWorkload
from kvflow.loadgen.no_reuse import NoReuseWorkload
from kvflow.loadgen.payloads import Api, EndpointConfig, request_body
from kvflow.loadgen.shared_prefix import SharedPrefixWorkload
from kvflow.loadgen.text import VOCAB_SIZE, WORDS, block_word_ids
from kvflow.loadgen.trace import TraceRecord
from kvflow.loadgen.trace_replay import TraceWorkload
from kvflow.loadgen.workload import BenchRequest, Workload, prompt_word_ids

CHAT = EndpointConfig("http://x/v1", "m")
COMPLETIONS = EndpointConfig("http://x/v1", "m", api=Api.COMPLETIONS)


def take(workload: Workload, n: int, seed: int = 7, namespace: str = "r0") -> list[BenchRequest]:
    return list(itertools.islice(workload.requests(seed=seed, namespace=namespace), n))


def bodies(requests: list[BenchRequest], config: EndpointConfig = CHAT) -> list[str]:
    return [json.dumps(request_body(config, r)) for r in requests]


ALL = [SharedPrefixWorkload(), MultiTurnWorkload(), NoReuseWorkload(prompt_words=64)]


@pytest.mark.parametrize("workload", ALL, ids=lambda w: w.name)
def test_seeded_workload_is_deterministic(workload: Workload) -> None:
    first, again = take(workload, 30), take(workload, 30)
    assert first == again
    assert bodies(first) == bodies(again)  # the rendered text too
    assert take(workload, 10) == first[:10]  # a longer run starts the same way
    other_seed = take(workload, 30, seed=8)
    assert bodies(other_seed) != bodies(first)
    # Another ladder rung: same shape (lengths), new text, so rungs do not warm each other.
    rung = take(workload, 30, namespace="r1")
    assert [r.num_prompt_words for r in rung] != [] and bodies(rung) != bodies(first)
    if workload.name == "no-reuse":
        assert [r.num_prompt_words for r in rung] == [r.num_prompt_words for r in first]


def test_blocks_are_prefix_consistent_and_in_vocabulary() -> None:
    full = block_word_ids("ns", "hash-5", 512)
    assert block_word_ids("ns", "hash-5", 100) == full[:100]
    assert block_word_ids("ns", "hash-6", 512) != full
    assert all(0 <= w < VOCAB_SIZE for w in full)
    assert len(set(WORDS)) == VOCAB_SIZE


def test_shared_prefix_groups_share_exactly_their_system_prompt() -> None:
    workload = SharedPrefixWorkload(num_groups=3, users_per_group=2, prefix_words=(40, 20),
                                    question_words=8, output_tokens=5)  # fmt: skip
    requests = take(workload, 40)
    systems: dict[str, set[str]] = {}
    questions = set()
    for body in (request_body(CHAT, r) for r in requests):
        system, user = body["messages"]
        assert (system["role"], user["role"]) == ("system", "user")
        assert body["max_tokens"] == 5 and body["ignore_eos"] is True and body["stream"]
        systems.setdefault(system["content"], set()).add(user["content"])
        questions.add(user["content"])
    assert len(systems) == 3  # one system prompt per group
    assert sorted(len(s.split()) for s in systems) == [20, 40, 40]  # groups 0, 2: 40; 1: 20
    assert len(questions) == 40  # every question is new
    assert {r.session_id for r in requests} <= {f"group{g}-user{u}" for g in range(3)
                                                  for u in range(2)}  # fmt: skip


def test_multi_turn_history_grows_and_is_resent_verbatim() -> None:
    workload = MultiTurnWorkload(num_active=2, num_turns=3, first_message_words=30,
                                 message_words=10, output_tokens=6)  # fmt: skip
    requests = take(workload, 12)
    by_session: dict[str, list[BenchRequest]] = {}
    for r in requests:
        by_session.setdefault(r.session_id, []).append(r)
    assert len(by_session) >= 3  # finished conversations are replaced by new ones
    for turns in by_session.values():
        assert len(turns) <= 3
        for k, (before, after) in enumerate(itertools.pairwise(turns)):
            assert after.segments[: len(before.segments)] == before.segments
            assert [s.role for s in after.segments][-3:] == ["user", "assistant", "user"]
            # 30 + (6 + 10) per earlier turn: the answer is as long as the output asked for.
            assert after.num_prompt_words == 30 + 16 * (k + 1)
            # The completions prompt of the earlier turn is a prefix of the later one's.
            assert prompt_word_ids(after)[: before.num_prompt_words] == prompt_word_ids(before)


def test_no_reuse_prompts_share_no_block() -> None:
    requests = take(NoReuseWorkload(prompt_words=32), 200)
    first_blocks = {tuple(prompt_word_ids(r)[:16]) for r in requests}
    assert len(first_blocks) == 200


def test_trace_replay_shares_blocks_by_hash_id_and_scales() -> None:
    records = [
        TraceRecord(1000.0, 1200, 10, (0, 1, 2)),  # 512 + 512 + 176
        TraceRecord(1500.0, 700, 20, (0, 3)),  # shares block 0, then 188 of block 3
        TraceRecord(4000.0, 1100, 1, (0, 1)),  # ids cover 1024: 76 new tokens after them
    ]
    full = take(TraceWorkload(records), 10)
    assert len(full) == 3  # a trace ends
    assert [r.trace_offset_s for r in full] == [0.0, 0.5, 3.0]
    assert [r.num_prompt_words for r in full] == [1200, 700, 1100]
    assert [r.num_output_tokens for r in full] == [10, 20, 1]
    words = [prompt_word_ids(r) for r in full]
    assert words[0][:512] == words[1][:512] == words[2][:512]
    assert words[0][512:1024] == words[2][512:1024]
    assert words[0][512:600] != words[1][512:600]
    assert words[2][1024:] != words[0][1024:1100]  # the uncovered tail is new text
    # Scaled by 1/8: 64-word blocks, still aligned to the hash ids.
    small = take(TraceWorkload(records, input_scale=1 / 8, output_scale=0.5), 10)
    assert [r.num_prompt_words for r in small] == [150, 88, 138]  # round(1200/8)...
    assert [r.num_output_tokens for r in small] == [5, 10, 1]  # never below 1
    small_words = [prompt_word_ids(r) for r in small]
    assert small_words[0][:64] == small_words[1][:64]
    assert small_words[0][:128] == small_words[2][:128]
    assert small_words[0][64:88] != small_words[1][64:88]


def test_completions_body_is_the_whole_prompt_as_text() -> None:
    request = take(SharedPrefixWorkload(prefix_words=(12,), question_words=4), 1)[0]
    body = request_body(COMPLETIONS, request)
    chat = request_body(CHAT, request)
    assert body["prompt"] == " ".join(m["content"] for m in chat["messages"])
    assert len(body["prompt"].split()) == 16
    assert "ignore_eos" not in request_body(EndpointConfig("u", "m", ignore_eos=False), request)
