"""The results page points at what it claims to: every link resolves.

docs/benchmarks.md states each figure next to its raw JSON in docs/bench-data/ and its plots
in docs/img/; docs/bench-data/HISTORY.md keeps the earlier runs. A JSON file renamed or a
section retitled would leave a figure without its evidence, or the index pointing nowhere,
and nothing else reads these pages, so this test does.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PAGE = ROOT / "docs" / "benchmarks.md"
HISTORY = ROOT / "docs" / "bench-data" / "HISTORY.md"

FENCE = re.compile(r"^(```|~~~).*?^\1", re.MULTILINE | re.DOTALL)
INDENTED_CODE = re.compile(r"^(?: {4}|\t).*$", re.MULTILINE)
INLINE_CODE = re.compile(r"`[^`\n]*`")
LINK = re.compile(r"!?\[[^\]\n]*\]\(([^)\s]+)\)")
HEADING = re.compile(r"^#{1,6}\s+(.+?)\s*#*\s*$", re.MULTILINE)
# A path into the repository's evidence, as commands and prose name it.
EVIDENCE_PATH = re.compile(r"(?<![\w./-])docs/(?:bench-data|img)/[\w./-]*[\w/]")


def prose(text: str) -> str:
    """The text outside code: a link inside a code block is an example, not a link."""
    text = FENCE.sub("", text)
    text = INDENTED_CODE.sub("", text)
    return INLINE_CODE.sub("", text)


def links(text: str) -> list[str]:
    return LINK.findall(prose(text))


def slug(heading: str) -> str:
    """GitHub's anchor for a heading: lower case, punctuation dropped, spaces to hyphens."""
    text = INLINE_CODE.sub(lambda m: m.group(0)[1:-1], heading).lower()
    text = re.sub(r"[^\w\- ]", "", text)
    return text.replace(" ", "-")


def anchors(text: str) -> set[str]:
    seen: dict[str, int] = {}
    out = set()
    for heading in HEADING.findall(FENCE.sub("", text)):
        base = slug(heading)
        count = seen.get(base, 0)
        seen[base] = count + 1
        out.add(base if count == 0 else f"{base}-{count}")
    return out


def test_slug_matches_githubs_rule() -> None:
    assert slug("KV transfer (PD)") == "kv-transfer-pd"
    assert slug("llama.cpp's server as a peer") == "llamacpps-server-as-a-peer"
    assert (
        slug("Routing comparison (virtual time, `kvflow sim compare`)")
        == "routing-comparison-virtual-time-kvflow-sim-compare"
    )


def test_links_skip_code_and_find_images() -> None:
    text = "see [a](x.json) and ![p](img/p.png)\n\n    [b](in-code.json)\n\n`[c](span.json)`\n"
    assert links(text) == ["x.json", "img/p.png"]


@pytest.mark.parametrize("page", [PAGE, HISTORY], ids=lambda p: p.name)
def test_every_relative_link_points_at_an_existing_file(page: Path) -> None:
    text = page.read_text()
    missing = []
    for target in links(text):
        if re.match(r"^[a-z][a-z0-9+.-]*:", target) or target.startswith("#"):
            continue  # a URL, or an anchor (checked below)
        path = target.split("#", 1)[0]
        if not (page.parent / path).exists():
            missing.append(target)
    assert not missing, f"{page.name} links to files that do not exist: {missing}"


def test_the_page_links_its_raw_json_and_plots() -> None:
    targets = links(PAGE.read_text())
    assert sum(t.endswith(".json") for t in targets) >= 20
    assert any(t.endswith(".png") for t in targets)
    assert "bench-data/HISTORY.md" in targets


def test_every_anchor_on_the_page_names_a_heading() -> None:
    text = PAGE.read_text()
    known = anchors(text)
    dangling = [t for t in links(text) if t.startswith("#") and t[1:] not in known]
    assert not dangling, f"anchors with no heading: {dangling}"


def test_every_evidence_path_the_page_names_exists() -> None:
    """Commands write their JSON where the page says the evidence is: it must be there."""
    named = set(EVIDENCE_PATH.findall(PAGE.read_text()))
    assert named, "the page names no docs/bench-data or docs/img path"
    missing = sorted(p for p in named if not (ROOT / p).exists())
    assert not missing, f"named but not in the repository: {missing}"


@pytest.mark.parametrize("page", [PAGE, HISTORY], ids=lambda p: p.name)
def test_the_pages_speak_of_runs_not_sessions(page: Path) -> None:
    numbered = re.findall(r"(?i)\bsessions? \d+", page.read_text())
    assert not numbered, f"{page.name} counts sessions: {numbered}"
