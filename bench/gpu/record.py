"""A stage's results on disk as it goes, so a stage killed at its budget keeps what it had.

Every ``set`` rewrites the stage's JSON file atomically (write, then rename): the parent
reads a whole file or the previous one, never half of one. ``part`` runs one measurement
and, if it raises, records the error under its name and lets the stage go on: a stage is
several independent measurements, and a partial result beats none.
"""

from __future__ import annotations

import contextlib
import json
import os
import time
import traceback
from collections.abc import Iterator
from pathlib import Path
from typing import Any


class Deadline:
    def __init__(self, budget_s: float) -> None:
        self.end = time.monotonic() + budget_s

    def left_s(self) -> float:
        return self.end - time.monotonic()


class Recorder:
    def __init__(self, path: Path) -> None:
        self.path = path
        self.data: dict[str, Any] = {}

    def set(self, key: str, value: Any) -> None:
        self.data[key] = value
        self.flush()

    def flush(self) -> None:
        tmp = self.path.with_suffix(".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str) + "\n")
        os.replace(tmp, self.path)

    @contextlib.contextmanager
    def part(self, name: str) -> Iterator[None]:
        """Run one measurement; on an exception record it (and its traceback) and go on.

        The catch-all is the point: this is the harness boundary, where a CUDA error, an
        out-of-memory or an API change in transformers must cost one row, not the run."""
        started = time.monotonic()
        try:
            yield
        except Exception as exc:
            self.data.setdefault("errors", {})[name] = f"{type(exc).__name__}: {exc}"
            self.data.setdefault("tracebacks", {})[name] = traceback.format_exc()[-4000:]
            print(f"[gpu_check] {name} failed: {type(exc).__name__}: {exc}", flush=True)
        finally:
            self.data.setdefault("part_s", {})[name] = round(time.monotonic() - started, 3)
            self.flush()


def log(msg: str) -> None:
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", flush=True)
