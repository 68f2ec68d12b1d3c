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


_ABOVE_FL = ("fedprivacy.engines", "fedprivacy.experiments", "fedprivacy.cli", "fedprivacy.run", "fedprivacy.deploy",
             "fedprivacy.audit")
_ABOVE_CORE = ("fedprivacy.config", "fedprivacy.devices", "fedprivacy.fl", "flwr", "ray") + _ABOVE_FL


@pytest.mark.parametrize(("folder", "forbidden"), [
    ("privacy", ("fedprivacy.optim", "fedprivacy.client", "fedprivacy.data", "fedprivacy.models") + _ABOVE_CORE),
    ("optim", ("fedprivacy.client", "fedprivacy.data", "fedprivacy.models") + _ABOVE_CORE),
    ("client", ("fedprivacy.data",) + _ABOVE_CORE),
    ("models", ("fedprivacy.client", "fedprivacy.data", "fedprivacy.optim", "fedprivacy.privacy") + _ABOVE_CORE),
    ("data", ("fedprivacy.client", "fedprivacy.models", "fedprivacy.optim", "fedprivacy.privacy") + _ABOVE_CORE),
    ("fl", _ABOVE_FL),
    ("engines", _ABOVE_FL[1:]),
    ("deploy", ("fedprivacy.experiments", "fedprivacy.cli", "fedprivacy.audit")),
    ("experiments", ("fedprivacy.cli",)),
])
def test_core_layers_import_nothing_above_them(folder, forbidden):
    bad = {module: sorted(n for n in names if any(n == f or n.startswith(f + ".") for f in forbidden))
           for module, names in _imports(folder).items()}
    assert not {m: n for m, n in bad.items() if n}


def test_no_import_cycle_between_modules():
    """Module-level imports among fedprivacy's modules form no cycle (imports inside functions are lazy)."""
    modules = {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
               for p in PACKAGE.rglob("*.py")}
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                       if isinstance(node, ast.ImportFrom) and node.module else [])
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    state: dict[str, int] = {}  # 1: on the current path, 2: done

    def visit(node: str, path: list[str]) -> None:
        state[node] = 1
        for dep in sorted(graph[node]):
            assert state.get(dep) != 1, "import cycle: " + " -> ".join(path[path.index(dep):] + [dep])
            if dep not in state:
                visit(dep, path + [dep])
        state[node] = 2

    for module in sorted(graph):
        if module not in state:
            visit(module, [module])
