"""The router's tokenizer and chat template against transformers' own loading of SmolLM2."""

from __future__ import annotations

from pathlib import Path

import pytest
from testkit.tokenizer_files import write_smollm2_tokenizer

from kvflow.router.text.gguf_metadata import GgufFormatError, read_gguf_metadata
from kvflow.router.text.model_files import TextModel, default_model_path, load_text_model
from kvflow.router.text.tokenizer import TokenizerLoadError, tokenizer_from_gguf_metadata

# Digits, byte-level edge cases (leading spaces, newlines, tabs), multi-byte characters,
# emoji, code, and special tokens written in the text.
CORPUS = [
    "Hello world",
    "The capital of France is",
    "  two leading spaces, and trailing  ",
    "Numbers: 12345, 3.14159, -42, 1e10, 2024-06-01, 0x1F",
    "a1b22c333 d4444",
    "line one\nline two\n\n\tindented\r\nwindows",
    "héllo wörld ça va? naïve café",
    "日本語のテキスト、中文文本，한국어 텍스트",
    "emoji 🙂🚀👩‍👩‍👧 and flags 🇫🇷",
    "def f(x):\n    return x ** 2  # square\n",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "don't won't I'm they're it's",
    "",
    " ",
    "a" * 300,
]

MESSAGES = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [
        {"role": "system", "content": "You are terse."},
        {"role": "user", "content": "Hi"},
        {"role": "assistant", "content": "Hello."},
        {"role": "user", "content": "Count to 3: 1, 2, 3 🙂"},
    ],
]


@pytest.fixture(scope="module")
def gguf_model() -> TextModel:
    return load_text_model(default_model_path())


@pytest.fixture(scope="module")
def hf_gguf_tokenizer():  # type: ignore[no-untyped-def]
    transformers = pytest.importorskip("transformers")  # the dev extra installs it
    path = default_model_path()
    return transformers.AutoTokenizer.from_pretrained(str(path.parent), gguf_file=path.name)


@pytest.mark.slow
def test_gguf_tokenizer_is_token_identical_to_transformers(gguf_model, hf_gguf_tokenizer) -> None:
    for text in CORPUS:
        ours = gguf_model.tokenizer.encode(text, add_special_tokens=True)
        theirs = hf_gguf_tokenizer(text)["input_ids"]
        assert ours == theirs, text
        assert gguf_model.tokenizer.decode(ours, skip_special_tokens=False) == text


@pytest.mark.slow
def test_gguf_chat_template_renders_like_transformers(gguf_model, hf_gguf_tokenizer) -> None:
    assert gguf_model.chat_template is not None
    for messages in MESSAGES:
        ours = gguf_model.chat_template.render(messages, add_generation_prompt=True)
        theirs = hf_gguf_tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
        assert ours == theirs


def test_gguf_facts(gguf_model) -> None:
    tokenizer = gguf_model.tokenizer
    assert tokenizer.vocab_size == 49152
    assert sorted(tokenizer.special_token_ids) == list(range(17))
    assert gguf_model.eos_token_ids == {2}
    assert gguf_model.max_model_len == 8192
    assert tokenizer.encode("<|im_start|>user", add_special_tokens=False)[0] == 1
    # Digits split one by one (the "smollm" pre-tokenizer), and no BOS is added.
    assert tokenizer.encode("12345", add_special_tokens=True) == [33, 34, 35, 36, 37]
    # A chat prompt starts with the system turn the template adds when none is given.
    prompt = gguf_model.chat_template.render([{"role": "user", "content": "Hi"}])
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
    assert prompt.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")


def test_token_bytes_cover_multibyte_characters(gguf_model) -> None:
    tokenizer = gguf_model.tokenizer
    for text in CORPUS:
        ids = tokenizer.encode(text, add_special_tokens=False)
        joined = b"".join(tokenizer.token_bytes(t) for t in ids)
        expected = tokenizer.decode(ids, skip_special_tokens=True).encode()
        assert joined == expected, text
    assert tokenizer.token_bytes(1) == b""  # special tokens have no text


@pytest.mark.slow
def test_folder_tokenizer_matches_gguf_and_transformers(tmp_path: Path, gguf_model) -> None:
    transformers = pytest.importorskip("transformers")
    folder = write_smollm2_tokenizer(tmp_path / "model")
    ours = load_text_model(folder)
    theirs = transformers.AutoTokenizer.from_pretrained(str(folder))
    for text in CORPUS:
        ids = ours.tokenizer.encode(text, add_special_tokens=True)
        assert ids == gguf_model.tokenizer.encode(text, add_special_tokens=True)
        assert ids == theirs(text)["input_ids"], text
    assert ours.chat_template is not None
    for messages in MESSAGES:
        assert ours.chat_template.render(messages) == theirs.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=True
        )
    assert ours.tokenizer.is_byte_level
    assert ours.eos_token_ids == {2}


def test_folder_without_tokenizer_says_what_to_pass(tmp_path: Path) -> None:
    with pytest.raises(TokenizerLoadError, match=r"tokenizer\.json"):
        load_text_model(tmp_path)
    with pytest.raises(TokenizerLoadError, match="no such file"):
        load_text_model(tmp_path / "missing")


def test_gguf_reader_rejects_other_files(tmp_path: Path) -> None:
    bad = tmp_path / "x.gguf"
    bad.write_bytes(b"NOPE" + bytes(20))
    with pytest.raises(GgufFormatError, match="bad magic"):
        read_gguf_metadata(bad)
    truncated = tmp_path / "y.gguf"
    truncated.write_bytes(default_model_path().read_bytes()[:1000])
    with pytest.raises(GgufFormatError, match="end of file"):
        read_gguf_metadata(truncated)


def test_unsupported_gguf_tokenizers_are_refused_with_the_alternative() -> None:
    metadata = read_gguf_metadata(default_model_path())
    with pytest.raises(TokenizerLoadError, match="Hugging Face folder"):
        tokenizer_from_gguf_metadata({**metadata, "tokenizer.ggml.model": "llama"})
    with pytest.raises(TokenizerLoadError, match="pre-tokenizer 'qwen2'"):
        tokenizer_from_gguf_metadata({**metadata, "tokenizer.ggml.pre": "qwen2"})
