"""The documentation's Python examples work. README.md's ServerApp runs against the stock ClientApp of
examples/dp_strategy.py and reports the epsilon the accountant gives its settings; every other Python block
in README.md and docs/ is either run by a test (``EXECUTED``) or an excerpt of an example under examples/
(which CI runs), line for line, comments aside; every YAML block is a run config that validates and keeps
the values it shows."""

import ast
import re
import runpy
from pathlib import Path

import pytest
import yaml

from fedprivacy.config import build_config
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.privacy.accounting import epsilon_for

ROOT = Path(__file__).parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").rglob("*.md"))]
README_SERVER_APP = "## Your own model: the DP strategy in any Flower ServerApp"
# (page, the heading its block sits under) -> the test that executes it
EXECUTED = {("README.md", README_SERVER_APP): "tests/test_docs_examples.py",
            ("docs/extending.md", "## Record-level DP in your own ClientApp"): "tests/sample_dp/test_record_dp_client.py",
            ("docs/YOUR_DATA.md", "## Flower Datasets"): "tests/data/test_flower_datasets.py"}


def python_blocks(text: str, language: str = "python") -> list[tuple[str, str]]:
    """(the heading above it, its code) for each fenced block of ``language`` (```python) of a Markdown page."""
    blocks, heading, fence, code = [], "", None, []
    for line in text.splitlines(keepends=True):
        if fence is None and line.startswith("```"):
            fence, code = line.strip()[3:], []
        elif fence is not None and line.strip() == "```":
            if fence == language:
                blocks.append((heading, "".join(code)))
            fence = None
        elif fence is not None:
            code.append(line)
        elif line.startswith("#"):
            heading = line.strip()
    return blocks


def code_lines(code: str) -> list[str]:
    """Its lines with comments and indentation stripped, blank and comment-only lines dropped."""
    return [c for c in (line.partition("  #")[0].strip() for line in code.splitlines()) if c and not c.startswith("#")]


def test_python_blocks_finds_the_blocks_under_their_headings_and_skips_other_languages():
    page = "# A\n```bash\nx = 1\n```\n## B\n```python\ny = 2  # two\n```\n"
    assert python_blocks(page) == [("## B", "y = 2  # two\n")]
    assert python_blocks(page, "bash") == [("# A", "x = 1\n")]
    assert code_lines("y = 2  # two\n# note\n\n    z = 3\n") == ["y = 2", "z = 3"]


def _page(relative: str) -> str:
    return (ROOT / relative).read_text()


def test_every_python_block_in_the_docs_is_run_or_an_excerpt_of_an_example():
    example_lines = {c for f in (ROOT / "examples").rglob("*.py") for c in code_lines(f.read_text())}
    unchecked = []
    for page in PAGES:
        name = page.relative_to(ROOT).as_posix()
        for heading, code in python_blocks(page.read_text()):
            if (name, heading) in EXECUTED:
                continue
            missing = [c for c in code_lines(code) if c not in example_lines]
            if missing:
                unchecked.append(f"{name} {heading!r}: {missing[0]!r}")
    assert not unchecked, "blocks neither run by a test nor excerpts of examples/:\n" + "\n".join(unchecked)


@pytest.mark.parametrize(("page", "heading"), sorted(EXECUTED))
def test_every_executed_block_is_still_where_its_test_reads_it(page, heading):
    assert [h for h, _ in python_blocks(_page(page))].count(heading) == 1


def test_the_readme_server_app_runs_twenty_rounds_and_reports_their_epsilon(capsys):
    (code,) = [c for h, c in python_blocks(_page("README.md")) if h == README_SERVER_APP]
    namespace: dict = {}
    exec(compile(code, "README.md", "exec"), namespace)
    client_app = runpy.run_path(str(ROOT / "examples" / "dp_strategy.py"))["client_app"]  # a stock PyTorch client
    run_inprocess(namespace["app"], client_app, 50)
    printed = ast.literal_eval(re.sub(r"np\.float64\(([^)]*)\)", r"\1", capsys.readouterr().out.strip().splitlines()[-1]))
    assert printed["rdp"] == pytest.approx(epsilon_for("poisson", 10 / 50, 1.0, 20, 1e-3, "rdp"), rel=1e-9)


def _leaves(tree: dict, path: tuple[str, ...] = ()):
    for key, value in tree.items():
        if isinstance(value, dict):
            yield from _leaves(value, (*path, key))
        else:
            yield (*path, key), value


@pytest.mark.parametrize("page", [p for p in PAGES if python_blocks(p.read_text(), "yaml")],
                         ids=lambda p: p.relative_to(ROOT).as_posix())
def test_every_yaml_block_in_the_docs_is_a_valid_run_config_that_keeps_its_values(page):
    for _, block in python_blocks(page.read_text(), "yaml"):
        tree = yaml.safe_load(block)
        dumped = build_config(tree, source=page.name).model_dump(mode="json")  # paths as the strings shown
        for path, value in _leaves(tree):
            field = dumped
            for key in path:
                field = field[key]
            assert field == value, path
