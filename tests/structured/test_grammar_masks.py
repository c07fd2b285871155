"""The worker's grammar engine on its own: vocabulary bytes, compile cache, masks.

A seeded random "model" (Gaussian logits) sampling under the mask must still write text in
the format; that is the whole guarantee, and it holds whatever the logits are.
"""

from __future__ import annotations

import json
from pathlib import Path

import jsonschema
import pytest
import torch
from testkit.structured_schemas import SCHEMAS
from testkit.tokenizer_files import (
    SMOLLM2_EOS_TOKEN_ID,
    SMOLLM2_VOCAB_SIZE,
    write_smollm2_tokenizer,
)

from kvflow.engine_worker.core.errors import InvalidRequestError
from kvflow.engine_worker.structured.grammar import (
    GrammarCompiler,
    GrammarSpec,
    entry_bytes,
    grammar_text,
)
from kvflow.engine_worker.structured.processor import GrammarLogitsProcessor
from kvflow.engine_worker.structured.vocabulary import Vocabulary, load_vocabulary

EOS = (SMOLLM2_EOS_TOKEN_ID,)


@pytest.fixture(scope="module")
def vocab(tmp_path_factory: pytest.TempPathFactory) -> Vocabulary:
    folder = write_smollm2_tokenizer(tmp_path_factory.mktemp("tok"))
    return load_vocabulary(folder, EOS)


@pytest.fixture(scope="module")
def compiler(vocab: Vocabulary) -> GrammarCompiler:
    return GrammarCompiler(vocab, SMOLLM2_VOCAB_SIZE)


def sample_under_mask(
    processor: GrammarLogitsProcessor, vocab: Vocabulary, seed: int, max_tokens: int = 200
) -> tuple[str, bool]:
    """Text sampled from random logits under the mask, and whether it ended with EOS."""
    generator = torch.Generator().manual_seed(seed)
    out: list[int] = []
    for _ in range(max_tokens):
        mask = processor.allowed_token_mask(out)
        assert mask is not None and mask.dtype == torch.bool and bool(mask.any())
        logits = torch.randn(SMOLLM2_VOCAB_SIZE, generator=generator)
        logits[: mask.shape[0]][~mask] = float("-inf")
        logits[mask.shape[0] :] = float("-inf")
        token = int(torch.multinomial(logits.softmax(-1), 1, generator=generator))
        if token in EOS:
            return b"".join(vocab.token_bytes[t] for t in out).decode(), True
        out.append(token)
    return b"".join(vocab.token_bytes[t] for t in out).decode(), False


@pytest.mark.parametrize("name", sorted(SCHEMAS))
def test_random_logits_under_a_schema_write_valid_json(
    name: str, compiler: GrammarCompiler, vocab: Vocabulary
) -> None:
    schema = SCHEMAS[name]
    for seed in range(3):
        spec = GrammarSpec("json_schema", json.dumps(schema))
        text, ended = sample_under_mask(GrammarLogitsProcessor.compile(compiler, spec), vocab, seed)
        assert ended, f"no EOS within 200 tokens: {text!r}"
        jsonschema.validate(json.loads(text), schema)


def test_regex_lark_and_ebnf_formats(compiler: GrammarCompiler, vocab: Vocabulary) -> None:
    cases = [
        (GrammarSpec("regex", r"[0-9]{3}-[a-z]{2}"), r"^[0-9]{3}-[a-z]{2}$"),
        (GrammarSpec("lark", 'start: "yes" | "no"'), r"^(yes|no)$"),
        (GrammarSpec("ebnf", 'root ::= "A" [0-9] [0-9]'), r"^A[0-9][0-9]$"),
    ]
    import re

    for spec, pattern in cases:
        text, ended = sample_under_mask(GrammarLogitsProcessor.compile(compiler, spec), vocab, 1)
        assert ended and re.match(pattern, text), (spec, text)


def test_json_object_is_an_object(compiler: GrammarCompiler, vocab: Vocabulary) -> None:
    processor = GrammarLogitsProcessor.compile(compiler, GrammarSpec("json_object"))
    mask = processor.allowed_token_mask([])
    assert mask is not None
    allowed = {vocab.token_bytes[i] for i in mask.nonzero()[:, 0].tolist()}
    assert allowed and all(b.startswith(b"{") for b in allowed), sorted(allowed)[:10]


def test_compiled_once_per_format_and_bounded(vocab: Vocabulary) -> None:
    a, b, c = (GrammarSpec("regex", r) for r in ("a+", "b+", "c+"))
    room = 2 * entry_bytes(a, grammar_text(a))  # two of the three (same sizes)
    compiler = GrammarCompiler(vocab, SMOLLM2_VOCAB_SIZE, cache_bytes=room)
    compiler.matcher(a)
    compiler.matcher(a)
    assert compiler.num_compiled == 1
    compiler.matcher(b)
    compiler.matcher(a)  # a is now the most recent; b the least
    compiler.matcher(c)  # evicts b
    assert compiler.num_compiled == 3
    compiler.matcher(a)
    assert compiler.num_compiled == 3
    compiler.matcher(b)
    assert compiler.num_compiled == 4


def test_each_request_gets_its_own_matcher_state(
    compiler: GrammarCompiler, vocab: Vocabulary
) -> None:
    spec = GrammarSpec("lark", 'start: "ab" | "cd"')
    first = GrammarLogitsProcessor.compile(compiler, spec)
    second = GrammarLogitsProcessor.compile(compiler, spec)
    first_mask = first.allowed_token_mask([])
    assert first_mask is not None
    token_a = vocab.token_bytes.index(b"a")
    assert bool(first_mask[token_a])
    after_a = first.allowed_token_mask([token_a])
    fresh = second.allowed_token_mask([])
    assert after_a is not None and fresh is not None
    assert not torch.equal(after_a, fresh)
    assert bool(fresh[token_a])


@pytest.mark.parametrize(
    ("spec", "words"),
    [
        (GrammarSpec("json_schema", '{"type": "strin"}'), "strin"),
        (GrammarSpec("json_schema", '{"$ref": "#/$defs/missing"}'), "missing"),
        (GrammarSpec("json_schema", "{not json"), "json_schema"),
        (GrammarSpec("regex", "a(b"), "unclosed group"),
        (GrammarSpec("lark", "start: undefined_rule"), "undefined_rule"),
    ],
)
def test_a_format_the_compiler_rejects_names_the_problem(
    spec: GrammarSpec, words: str, compiler: GrammarCompiler
) -> None:
    with pytest.raises(InvalidRequestError, match=words):
        compiler.matcher(spec)


def test_a_token_outside_the_grammar_ends_the_request_with_eos(
    compiler: GrammarCompiler, vocab: Vocabulary
) -> None:
    processor = GrammarLogitsProcessor.compile(compiler, GrammarSpec("regex", "[0-9]+"))
    letter = vocab.token_bytes.index(b"x")
    mask = processor.allowed_token_mask([letter])  # never allowed: the matcher errs
    assert mask is not None
    assert mask.nonzero()[:, 0].tolist() == list(EOS)


def test_gguf_and_tokenizer_json_vocabularies_agree(vocab: Vocabulary) -> None:
    from_gguf = load_vocabulary(None, EOS)  # the built-in SmolLM2 GGUF
    assert from_gguf.num_tokens == vocab.num_tokens == SMOLLM2_VOCAB_SIZE
    differ = [i for i in range(vocab.num_tokens)
              if from_gguf.token_bytes[i] != vocab.token_bytes[i]]  # fmt: skip
    assert differ == []
    assert from_gguf.special_token_ids == vocab.special_token_ids
    assert from_gguf.token_bytes[216] == vocab.token_bytes[216]


def test_a_folder_without_tokenizer_is_a_clear_error(tmp_path: Path) -> None:
    from kvflow.engine_worker.model.errors import ModelLoadError

    with pytest.raises(ModelLoadError, match=r"tokenizer\.json"):
        load_vocabulary(tmp_path, EOS)
