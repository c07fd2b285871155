"""The Dockerfiles build from the repository alone and match what the operator expects.

No Docker here (see e2e/README.md), so check what can be checked without one.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

from kvflow.operator.builders.names import IMAGE_UID

REPO = Path(__file__).resolve().parents[2]
DOCKERFILES = sorted((REPO / "docker").glob("*.Dockerfile"))


def test_one_image_per_component() -> None:
    assert [d.stem for d in DOCKERFILES] == ["operator", "router", "worker"]


@pytest.mark.parametrize("dockerfile", DOCKERFILES, ids=[d.stem for d in DOCKERFILES])
def test_dockerfile_copies_only_what_exists_and_runs_as_the_pods_uid(dockerfile: Path) -> None:
    text = dockerfile.read_text()
    for sources in re.findall(r"^COPY (?!--from)(.+) \S+$", text, flags=re.MULTILINE):
        for source in sources.split():
            assert (REPO / source).exists(), f"{dockerfile.name} copies missing {source}"
    assert f"USER {IMAGE_UID}:{IMAGE_UID}" in text
    assert f"--uid {IMAGE_UID}" in text
    assert 'ENTRYPOINT ["kvflow"]' in text
    assert f"pip install '.[{dockerfile.stem}]'" in text  # each image installs its extra
    ignore = dockerfile.with_name(dockerfile.name + ".dockerignore")
    assert ignore.exists() and ".venv" in ignore.read_text()
