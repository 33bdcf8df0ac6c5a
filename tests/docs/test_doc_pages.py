"""The docs' own promises: links resolve; the design pages stay short, drawn and complete.

Pure file checks (no services). Links: every relative link in README.md and docs/ names a file of
the repository and, with a ``#fragment``, a heading of that file (GitHub's anchor rule). Design
pages (docs/design/): one mermaid diagram each, lines within 100 characters, no paragraph longer
than 90 words, and every module of the subsystem packages named in some page's file table, so a
newcomer finds each file from the page of its path.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
DOCS = ROOT / "docs"
DESIGN = DOCS / "design"
PAGES = sorted([ROOT / "README.md", *DOCS.rglob("*.md")])
DESIGN_PAGES = sorted(DESIGN.glob("*.md"))
PATH_PAGES = [page for page in DESIGN_PAGES if page.name != "README.md"]
MAPPED_PACKAGES = ("router", "prefix_keys", "gpu_node", "coordinator", "events", "identity")
MAX_LINE_CHARS = 100
MAX_PARAGRAPH_WORDS = 90

_FENCE = re.compile(r"^```.*?^```", re.S | re.M)
_CODE_SPAN = re.compile(r"`[^`\n]*`")
_INLINE_LINK = re.compile(r"\]\(([^)\s]+)\)")
_REFERENCE_LINK = re.compile(r"^\[[^\]]+\]:\s*(\S+)", re.M)


def _prose(text: str) -> str:
    """The text without fenced blocks and code spans, where a ``](`` is not a link."""
    return _CODE_SPAN.sub("", _FENCE.sub("", text))


def _anchors(markdown: Path) -> set[str]:
    """GitHub's heading anchors: lower case, no punctuation, spaces to hyphens, repeats numbered."""
    anchors: set[str] = set()
    for line in _FENCE.sub("", markdown.read_text()).splitlines():
        if not line.startswith("#"):
            continue
        slug = re.sub(r"[^\w\- ]", "", line.lstrip("#").strip().lower()).replace(" ", "-")
        candidate, number = slug, 0
        while candidate in anchors:
            number += 1
            candidate = f"{slug}-{number}"
        anchors.add(candidate)
    return anchors


def _links(page: Path) -> list[str]:
    prose = _prose(page.read_text())
    return _INLINE_LINK.findall(prose) + _REFERENCE_LINK.findall(prose)


@pytest.mark.parametrize("page", PAGES, ids=lambda page: str(page.relative_to(ROOT)))
def test_relative_links_resolve(page: Path) -> None:
    broken = []
    for link in _links(page):
        if re.match(r"[a-z]+:", link):
            continue  # http(s), mailto: not ours to check offline
        target, _, fragment = link.partition("#")
        path = (page.parent / target).resolve() if target else page
        if not path.exists():
            broken.append(f"{link} (no such file)")
        elif fragment and path.suffix == ".md" and fragment not in _anchors(path):
            broken.append(f"{link} (no such heading)")
    assert not broken, f"{page.relative_to(ROOT)}: broken links {broken}"


def test_the_design_pages_exist() -> None:
    paths = {"request-path.md", "kv-events.md", "invalidation.md", "erasure.md"}
    assert {page.name for page in PATH_PAGES} == paths
    index = (DESIGN / "README.md").read_text()
    unlinked = [name for name in paths if f"({name})" not in index and f": {name}" not in index]
    assert not unlinked, f"the overview does not link {unlinked}"


@pytest.mark.parametrize("page", DESIGN_PAGES, ids=lambda page: page.name)
def test_design_page_is_short_and_drawn(page: Path) -> None:
    text = page.read_text()
    kind = "flowchart" if page.name == "README.md" else "sequenceDiagram"
    diagrams = re.findall(r"^```mermaid\n(\w+)", text, re.M)
    assert diagrams == [kind], f"{page.name}: one mermaid {kind}, found {diagrams}"
    text_lines = text.splitlines()
    # Table rows name files by their full path and cannot wrap; prose can.
    long_lines = [
        n
        for n, line in enumerate(text_lines, 1)
        if len(line) > MAX_LINE_CHARS and not line.startswith("|")
    ]
    assert not long_lines, f"{page.name}: lines over {MAX_LINE_CHARS} characters: {long_lines}"
    for paragraph in re.split(r"\n\s*\n", _FENCE.sub("", text)):
        lines = paragraph.strip().splitlines()
        if not lines or lines[0].startswith(("#", "|")):
            continue
        words = len(" ".join(lines).split())
        assert words <= MAX_PARAGRAPH_WORDS, f"{page.name}: {words} words in {lines[0]!r}"


def test_every_module_is_mapped_from_a_design_page() -> None:
    tables = "\n".join(page.read_text() for page in DESIGN_PAGES)
    mapped = set(re.findall(r"^\| `([^`]+)` \|", tables, re.M))
    sources = [path for package in MAPPED_PACKAGES for path in (ROOT / package).rglob("*.py")]
    modules = {str(path.relative_to(ROOT)) for path in sources if path.name != "__init__.py"}
    assert not modules - mapped, f"modules no design page maps: {sorted(modules - mapped)}"
    gone = {path for path in mapped if path.endswith(".py") and not (ROOT / path).exists()}
    assert not gone, f"design pages map files that do not exist: {sorted(gone)}"
