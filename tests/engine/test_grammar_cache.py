"""The worker's compiled-grammar cache is bounded by bytes (``--grammar-cache-mib``): each
compiled format counts an estimate of its size (structured/grammar.py, entry_bytes), the
least recently used go first, and a format larger than the whole cache is served but not
kept. Real llguidance compiles over SmolLM2's vocabulary."""

from __future__ import annotations

import json

import pytest
from testkit.tokenizer_files import (
    SMOLLM2_EOS_TOKEN_ID,
    SMOLLM2_VOCAB_SIZE,
    write_smollm2_tokenizer,
)

from kvflow.engine_worker.settings import parse_args
from kvflow.engine_worker.structured.byte_lru import ByteLru
from kvflow.engine_worker.structured.grammar import (
    DEFAULT_CACHE_MIB,
    GrammarCompiler,
    GrammarSpec,
    entry_bytes,
    grammar_text,
)
from kvflow.engine_worker.structured.vocabulary import Vocabulary, load_vocabulary


def test_the_least_recently_used_go_until_the_bytes_fit() -> None:
    lru: ByteLru[str, int] = ByteLru(100)
    lru.put("a", 1, 40)
    lru.put("b", 2, 40)
    assert lru.get("a") == 1  # a is now the most recent
    lru.put("c", 3, 40)  # 120 > 100: b goes
    assert "b" not in lru and lru.get("a") == 1 and lru.get("c") == 3
    assert lru.num_bytes == 80
    lru.put("d", 4, 90)  # only d fits
    assert len(lru) == 1 and lru.num_bytes == 90
    lru.put("d", 5, 10)  # a new size replaces the old one
    assert lru.get("d") == 5 and lru.num_bytes == 10
    lru.put("huge", 6, 101)  # larger than the cache: not kept, nothing evicted
    assert "huge" not in lru and lru.get("d") == 5 and lru.num_bytes == 10


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Vocabulary:
    folder = write_smollm2_tokenizer(tmp_path_factory.mktemp("tok"))
    return load_vocabulary(folder, (SMOLLM2_EOS_TOKEN_ID,))


def schema(num_properties: int, tag: str) -> GrammarSpec:
    properties = {f"{tag}{k}": {"type": "integer"} for k in range(num_properties)}
    return GrammarSpec("json_schema", json.dumps({"type": "object", "properties": properties}))


def test_a_large_grammar_evicts_by_its_size_not_by_a_count(vocab: Vocabulary) -> None:
    small = [GrammarSpec("regex", f"{c}+") for c in "abcdef"]
    big = schema(60, "p")
    small_bytes = entry_bytes(small[0], grammar_text(small[0]))
    big_bytes = entry_bytes(big, grammar_text(big))
    assert big_bytes > 3 * small_bytes  # the estimate grows with the grammar
    room = 6 * small_bytes
    compiler = GrammarCompiler(vocab, SMOLLM2_VOCAB_SIZE, cache_bytes=room)
    for spec in small:
        compiler.matcher(spec)
    assert len(compiler.cache) == 6 and compiler.num_compiled == 6
    compiler.matcher(big)  # makes room by evicting the least recent small ones
    assert big in compiler.cache and compiler.cache.num_bytes <= room
    evicted = [s for s in small if s not in compiler.cache]
    assert evicted == small[: len(evicted)] and len(evicted) >= 3
    compiler.matcher(small[0])  # evicted: compiled again
    assert compiler.num_compiled == 8
    compiler.matcher(big)  # kept: not compiled again
    assert compiler.num_compiled == 8


def test_a_grammar_larger_than_the_cache_is_served_but_not_kept(vocab: Vocabulary) -> None:
    a = GrammarSpec("regex", "a+")
    big = schema(60, "q")
    compiler = GrammarCompiler(
        vocab, SMOLLM2_VOCAB_SIZE, cache_bytes=entry_bytes(big, grammar_text(big)) - 1
    )
    compiler.matcher(a)
    for _ in range(2):
        assert not compiler.matcher(big).is_error()
    assert compiler.num_compiled == 3 and big not in compiler.cache and a in compiler.cache


def test_the_flag_sets_the_bound_in_mib() -> None:
    assert parse_args([]).grammar_cache_mib == DEFAULT_CACHE_MIB
    assert parse_args(["--grammar-cache-mib", "8"]).grammar_cache_mib == 8
    with pytest.raises(SystemExit):
        parse_args(["--grammar-cache-mib", "0"])
