"""Imports point downward only (ARCHITECTURE "Layers"): checked on the source, every import statement
(module level and inside functions) of every module."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "fedprivacy"


def _imports(folder: str) -> dict[str, set[str]]:
    out = {}
    for path in sorted((PACKAGE / folder).rglob("*.py")):
        names = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Import):
                names |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom) and node.module:
                names.add(node.module)
        out[str(path.relative_to(PACKAGE))] = names
    return out


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("privacy", ("fedprivacy.optim", "fedprivacy.fl", "fedprivacy.config", "fedprivacy.engines", "flwr")),
    ("optim", ("fedprivacy.config", "fedprivacy.data", "fedprivacy.fl", "fedprivacy.engines", "flwr")),
    ("experiments", ("fedprivacy.cli",)),
])
def test_core_layers_import_nothing_above_them(folder, forbidden):
    bad = {module: sorted(n for n in names if n.startswith(forbidden))
           for module, names in _imports(folder).items()}
    assert not {m: n for m, n in bad.items() if n}
