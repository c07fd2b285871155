"""A disk cache of dequantized GGUF files, so only the first load pays for dequantizing.

For SmolLM2 reading the GGUF costs about 5 s on a 2-core CPU (2.6 s parsing the tokenizer
tables, 2 s dequantizing); the cached float32 safetensors file (540 MB) loads in about 1 s
because it is memory-mapped and needs no conversion.

An entry is keyed by the GGUF's file name and a digest of its contents, plus ``_FORMAT``
for changes to what we store. Not by its path: the built-in model lives inside a virtual
environment, and every checkout (every CI clone) has its own, so a path key left one
540 MB entry per clone until a CI machine ran out of disk. Hashing the file costs about
0.1 s against the 5 s conversion it saves. Writing a new entry deletes the other entries
of the same file name, so the cache holds at most one entry per model file name.

Every cache failure (a read-only or missing directory, a corrupt entry, a full disk) is
logged and the load goes on without the cache: it is an optimisation, never a reason to
fail.

Location: ``$KVFLOW_CACHE_DIR``, else ``$XDG_CACHE_HOME/kvflow``, else ``~/.cache/kvflow``.
"""

from __future__ import annotations

import glob
import hashlib
import json
import logging
import os
import re
import tempfile
from pathlib import Path

from safetensors import SafetensorError
from safetensors.torch import save_file

from kvflow.engine_worker.cache_dir import cache_dir
from kvflow.engine_worker.model.config import ModelConfig
from kvflow.engine_worker.model.errors import ModelLoadError
from kvflow.engine_worker.model.gguf_file import GgufContents, read_gguf
from kvflow.engine_worker.model.hf_folder import SafetensorsTensors

# Bump when the conversion changes what an entry holds (names, un-permutation, dtype).
_FORMAT = "1"
_HASH_CHUNK_BYTES = 8 << 20

log = logging.getLogger(__name__)


def cache_entry(gguf_path: Path) -> Path:
    """The cache file for this GGUF's current contents (it may not exist yet)."""
    real = gguf_path.resolve()
    content = hashlib.sha256(_FORMAT.encode())
    with real.open("rb") as handle:
        while chunk := handle.read(_HASH_CHUNK_BYTES):
            content.update(chunk)
    return cache_dir() / f"{real.stem}-{content.hexdigest()[:32]}.safetensors"


def read_gguf_cached(gguf_path: Path) -> GgufContents:
    """Like ``read_gguf``, served from the cache when an entry for this file exists."""
    entry = cache_entry(gguf_path)
    if entry.is_file():
        try:
            return _read_entry(entry)
        except (ModelLoadError, SafetensorError, KeyError, ValueError) as err:
            log.warning("ignoring unreadable model cache entry %s: %s", entry, err)
    contents = read_gguf(gguf_path)
    _write_entry(entry, contents)
    return contents


def _read_entry(entry: Path) -> GgufContents:
    tensors = SafetensorsTensors([entry])
    config = ModelConfig.from_json(tensors.metadata["config"])
    gguf_names: dict[str, str] = json.loads(tensors.metadata["gguf_names"])
    return config, tensors, gguf_names


def _write_entry(entry: Path, contents: GgufContents) -> None:
    config, tensors, gguf_names = contents
    metadata = {"config": config.to_json(), "gguf_names": json.dumps(gguf_names)}
    try:
        entry.parent.mkdir(parents=True, exist_ok=True)
        # Write aside, then rename: a reader never sees half a file, and two workers
        # converting the same model at once both end with a whole entry.
        fd, tmp = tempfile.mkstemp(dir=entry.parent, prefix=".tmp-", suffix=".safetensors")
        os.close(fd)
        try:
            save_file(dict(tensors), tmp, metadata=metadata)
            os.chmod(tmp, 0o644)  # mkstemp makes it private; a shared cache dir should work
            os.replace(tmp, entry)
        finally:
            Path(tmp).unlink(missing_ok=True)
    except OSError as err:
        log.warning("not caching the dequantized model in %s: %s", entry.parent, err)
        return
    stem = entry.name.rsplit("-", 1)[0]
    # Older contents of this file name, in this scheme or the old path-keyed one.
    digests = r"-([0-9a-f]{32}|[0-9a-f]{16}-[0-9a-f]{16})\.safetensors"
    same_name = re.compile(re.escape(stem) + digests)
    for stale in entry.parent.glob(f"{glob.escape(stem)}-*.safetensors"):
        if stale != entry and same_name.fullmatch(stale.name):
            try:
                stale.unlink(missing_ok=True)
            except OSError as err:
                log.warning("could not remove the stale model cache entry %s: %s", stale, err)
