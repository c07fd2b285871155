"""The dequantized-GGUF cache: used when valid, renewed when the file changes, never fatal."""

from __future__ import annotations

import logging
from pathlib import Path

import gguf
import pytest
import torch
from testkit.tiny_gguf import write_tiny_gguf
from testkit.tiny_model import write_tiny_llama

from kvflow.engine_worker.model import gguf_cache
from kvflow.engine_worker.model.gguf_file import GgufContents, read_gguf
from kvflow.engine_worker.model.loader import load_model


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "cache"))
    return tmp_path / "cache"


@pytest.fixture
def tiny_gguf(tmp_path: Path) -> Path:
    folder = write_tiny_llama(tmp_path / "tiny", vocab_size=512)
    return write_tiny_gguf(
        folder, tmp_path / "tiny.gguf", matrix_type=gguf.GGMLQuantizationType.Q8_0
    )


def parameters(path: Path) -> dict[str, torch.Tensor]:
    model, _ = load_model(path, quantization="none")  # the cache holds widened weights
    return dict(model.named_parameters())


def count_conversions(monkeypatch: pytest.MonkeyPatch) -> list[Path]:
    """Record every real GGUF read the cache falls back to."""
    reads: list[Path] = []

    def counting_read(path: Path) -> GgufContents:
        reads.append(path)
        return read_gguf(path)

    monkeypatch.setattr(f"{gguf_cache.__name__}.read_gguf", counting_read)
    return reads


def assert_same(a: dict[str, torch.Tensor], b: dict[str, torch.Tensor]) -> None:
    assert a.keys() == b.keys()
    for name, tensor in a.items():
        assert torch.equal(tensor, b[name]), name


def test_second_load_comes_from_the_cache_with_identical_weights(
    cache: Path, tiny_gguf: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = count_conversions(monkeypatch)
    first = parameters(tiny_gguf)
    entries = list(cache.glob("*.safetensors"))
    assert [e.name.split("-")[0] for e in entries] == ["tiny"]
    assert entries == [gguf_cache.cache_entry(tiny_gguf)]
    second = parameters(tiny_gguf)
    assert reads == [tiny_gguf]  # only the first load read the GGUF
    assert_same(first, second)


def test_a_changed_file_gets_a_new_entry_and_the_old_one_goes(
    cache: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    reads = count_conversions(monkeypatch)
    first = parameters(tiny_gguf)
    old_entry = gguf_cache.cache_entry(tiny_gguf)
    other = write_tiny_llama(tmp_path / "other", vocab_size=512, seed=1)
    write_tiny_gguf(other, tiny_gguf, matrix_type=gguf.GGMLQuantizationType.Q8_0)
    second = parameters(tiny_gguf)
    assert len(reads) == 2
    assert list(cache.glob("*.safetensors")) == [gguf_cache.cache_entry(tiny_gguf)] != [old_entry]
    assert any(not torch.equal(first[name], second[name]) for name in first)


def test_copies_in_two_places_share_one_entry(
    cache: Path, tiny_gguf: Path, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The built-in model sits in each checkout's own virtual environment: a path-keyed
    # cache grew by 540 MB per CI clone. A copy, even with a new mtime, is the same model.
    copy = tmp_path / "elsewhere" / tiny_gguf.name
    copy.parent.mkdir()
    copy.write_bytes(tiny_gguf.read_bytes())
    reads = count_conversions(monkeypatch)
    assert_same(parameters(tiny_gguf), parameters(copy))
    assert reads == [tiny_gguf]
    assert list(cache.glob("*.safetensors")) == [gguf_cache.cache_entry(copy)]


def test_entries_of_the_old_path_keyed_scheme_are_removed(cache: Path, tiny_gguf: Path) -> None:
    cache.mkdir()
    stale = cache / f"{tiny_gguf.stem}-{'a' * 16}-{'b' * 16}.safetensors"
    stale.write_bytes(b"old")
    unrelated = cache / f"{tiny_gguf.stem}-v2-{'c' * 32}.safetensors"  # another model file
    unrelated.write_bytes(b"other")
    parameters(tiny_gguf)
    assert sorted(cache.glob("*.safetensors")) == sorted(
        [gguf_cache.cache_entry(tiny_gguf), unrelated]
    )


def test_an_unusable_cache_directory_only_costs_the_cache(
    tmp_path: Path,
    tiny_gguf: Path,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    blocker = tmp_path / "a-file"
    blocker.write_text("")
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(blocker / "cache"))  # cannot be created
    reads = count_conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        first, second = parameters(tiny_gguf), parameters(tiny_gguf)
    assert len(reads) == 2
    assert_same(first, second)
    assert "not caching the dequantized model" in caplog.text


@pytest.mark.parametrize("damage", ["garbage", "truncated"])
def test_a_corrupt_entry_is_replaced(
    cache: Path,
    tiny_gguf: Path,
    damage: str,
    monkeypatch: pytest.MonkeyPatch,
    caplog: pytest.LogCaptureFixture,
) -> None:
    reference = parameters(tiny_gguf)
    entry = gguf_cache.cache_entry(tiny_gguf)
    if damage == "garbage":
        entry.write_bytes(b"\x10\x00\x00\x00\x00\x00\x00\x00{not json")
    else:
        entry.write_bytes(entry.read_bytes()[: entry.stat().st_size // 2])
    reads = count_conversions(monkeypatch)
    with caplog.at_level(logging.WARNING, logger=gguf_cache.__name__):
        assert_same(parameters(tiny_gguf), reference)
    assert len(reads) == 1 and "ignoring unreadable model cache entry" in caplog.text
    assert_same(parameters(tiny_gguf), reference)
    assert len(reads) == 1  # the rewritten entry serves the third load


def test_cache_location_precedence(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.delenv("KVFLOW_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert gguf_cache.cache_dir() == tmp_path / "home" / ".cache" / "kvflow"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert gguf_cache.cache_dir() == tmp_path / "xdg" / "kvflow"
    monkeypatch.setenv("KVFLOW_CACHE_DIR", str(tmp_path / "mine"))
    assert gguf_cache.cache_dir() == tmp_path / "mine"
