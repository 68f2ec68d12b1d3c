"""BENCHMARKS.md: one section per workload script, an index whose links reach its sections, each section naming
its command and date, and no issue numbers on it or on the history page it points to."""

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
PAGE = REPO / "BENCHMARKS.md"
HISTORY = REPO / "docs" / "benchmarks-history.md"
HELPERS = {"bare_loop.py", "bare_next_word.py", "pfl_round.py", "pfl_next_word.py", "pfl_common.py", "machine.py"}


def _sections(text: str) -> dict[str, str]:
    """Each ``## `` heading's text -> its section's body (up to the next ``## `` heading)."""
    parts = re.split(r"^## (.+)$", text, flags=re.M)
    return dict(zip(parts[1::2], parts[2::2]))


def _slug(heading: str) -> str:
    """The anchor GitHub (and mkdocs' default toc) gives a heading: lower case, punctuation dropped, spaces -> '-'."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def test_every_workload_script_has_a_section_naming_its_command_and_date():
    sections = _sections(PAGE.read_text())
    scripts = sorted(p.name for p in (REPO / "benchmarks").glob("*.py"))
    for script in scripts:
        if script in HELPERS:
            continue
        owning = [name for name, body in sections.items() if f"benchmarks/{script}" in body]
        assert owning, f"BENCHMARKS.md: no section runs benchmarks/{script}"
        for name in owning:
            assert re.search(r"2026-\d\d-\d\d", sections[name]), f"BENCHMARKS.md, {name!r}: no date"


def test_the_index_links_reach_the_sections_and_lists_each_one():
    text = PAGE.read_text()
    index = _sections(text)["Index"]
    links = re.findall(r"\]\(#([^)]+)\)", index)
    anchors = {_slug(name) for name in _sections(text) if name != "Index"}
    assert sorted(links) == sorted(anchors)


@pytest.mark.parametrize("page", [PAGE, HISTORY], ids=lambda p: p.name)
def test_no_issue_numbers_on_the_benchmark_pages(page):
    hits = [line for line in page.read_text().splitlines() if re.search(r"\bissues?\b", line, flags=re.I)]
    assert hits == []


def test_the_two_pages_point_at_each_other():
    assert "(docs/benchmarks-history.md)" in PAGE.read_text()
    # BENCHMARKS.md is outside the docs site, so the history names it instead of linking (a link would fail the build)
    assert "current numbers are in BENCHMARKS.md" in HISTORY.read_text().splitlines()[2]
