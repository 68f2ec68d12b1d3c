"""The public API (README "Your own model") is importable from ``fedprivacy`` and from its package, each name
imported only when first used, so importing the core does not import Flower."""

import ast
import importlib
import subprocess
import sys
from pathlib import Path

import pytest

PACKAGES = ("fedprivacy", "fedprivacy.fl", "fedprivacy.privacy", "fedprivacy.optim", "fedprivacy.engines")


def _type_checking_imports(package: str) -> dict[str, str]:
    """name -> module of the imports under ``if TYPE_CHECKING:`` in the package's ``__init__``."""
    source = Path(importlib.import_module(package).__file__).read_text()
    out = {}
    for node in ast.parse(source).body:
        if isinstance(node, ast.If) and getattr(node.test, "id", None) == "TYPE_CHECKING":
            for imp in node.body:
                out |= {a.name: imp.module for a in imp.names}
    return out


@pytest.mark.parametrize("package", PACKAGES)
def test_every_exported_name_is_its_modules_object(package):
    module = importlib.import_module(package)
    declared = _type_checking_imports(package)
    assert sorted(module.__all__) == sorted(declared)  # what type checkers see is what __all__ promises
    for name, source in declared.items():
        assert getattr(module, name) is getattr(importlib.import_module(source), name)
    with pytest.raises(AttributeError, match="no attribute 'nothing'"):
        module.nothing


def test_the_root_exports_every_packages_public_names():
    root = importlib.import_module("fedprivacy")
    for package in PACKAGES[1:]:
        assert set(importlib.import_module(package).__all__) <= set(root.__all__)


def test_importing_the_core_imports_no_flower():
    code = ("import sys, fedprivacy, fedprivacy.privacy.aggregation, fedprivacy.optim.server_step, "
            "fedprivacy.client.trainer; print(sorted(m for m in ('flwr', 'ray', 'opacus') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout
    assert out.strip() == "[]"


NOT_FOR_THE_STRATEGY = ("pydantic", "pandas", "yaml", "matplotlib", "fedprivacy.config", "fedprivacy.outputs",
                        "fedprivacy.devices", "fedprivacy.stackoverflow_tasks", "fedprivacy.data", "fedprivacy.engines",
                        "fedprivacy.run", "fedprivacy.audit", "fedprivacy.deploy", "fedprivacy.experiments",
                        "fedprivacy.cli")
"""What ``fedprivacy run`` needs and a ServerApp with :class:`~fedprivacy.fl.strategy.DPFedAvg` does not: the typed
config (pydantic, YAML), the run folder (pandas, matplotlib), the StackOverflow data, the engines and commands."""


def test_the_strategy_loads_no_application_layer():
    """``import fedprivacy; fedprivacy.DPFedAvg`` in a fresh interpreter leaves every module (and submodule) of
    :data:`NOT_FOR_THE_STRATEGY` unloaded."""
    code = (f"import sys, fedprivacy; fedprivacy.DPFedAvg; names = {NOT_FOR_THE_STRATEGY!r}; "
            "print(sorted(m for m in sys.modules if any(m == n or m.startswith(n + '.') for n in names)))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         cwd=Path(__file__).parents[1]).stdout
    assert out.strip() == "[]"
