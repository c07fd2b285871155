"""The device machine's Python as far as imports go: no ``gguf`` (its image has torch,
transformers, numpy, safetensors and pytest, and reaches no registry).

``env_without(tmp, "gguf")`` writes a ``sitecustomize`` that marks the modules absent
(``sys.modules[name] = None``: ``import`` raises ModuleNotFoundError and
``importlib.util.find_spec`` answers None, as for a package that is not installed) and
returns the environment whose PYTHONPATH puts it first, for a subprocess.
"""

from __future__ import annotations

import os
from pathlib import Path

BLOCKER = """\
import sys
for _name in {names!r}:
    sys.modules[_name] = None  # absent, as on the device image
"""


def env_without(tmp: Path, *names: str) -> dict[str, str]:
    site = tmp / "device-image-site"
    site.mkdir(parents=True, exist_ok=True)
    (site / "sitecustomize.py").write_text(BLOCKER.format(names=list(names)))
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(site)] + [p for p in [env.get("PYTHONPATH")] if p])
    return env
