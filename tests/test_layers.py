"""Imports point downward only (ARCHITECTURE "Layers"): checked on the source, every import statement
(module level, inside functions and under ``TYPE_CHECKING``) of every module of the package."""

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).parents[1] / "fedprivacy"

LAYERS: dict[str, tuple[str, ...]] = {
    # each part of the package -> the parts it may import directly (and, through them, what they may import)
    "fedprivacy.updates": (),  # the update a client sends and why a reply is rejected
    "fedprivacy.task": (),  # the Task protocol
    "fedprivacy.locks": (),
    "fedprivacy.stopping": (),  # a stop between rounds, asked by SIGTERM
    "fedprivacy.callbacks": (),  # what a run calls after each recorded round
    "fedprivacy.checkpoints": (),  # checkpoint files written atomically, and the error a damaged one raises
    "fedprivacy.lazy_exports": (),  # the packages' re-exports, imported on first use
    "fedprivacy.privacy": ("fedprivacy.updates", "fedprivacy.lazy_exports"),  # core: no config, no Flower
    "fedprivacy.optim": ("fedprivacy.privacy",),
    "fedprivacy.models": (),
    "fedprivacy.data": (),
    "fedprivacy.client": ("fedprivacy.optim", "fedprivacy.models"),
    "fedprivacy.centralized": ("fedprivacy.client",),
    "fedprivacy.config": ("fedprivacy.optim",),  # the typed config checks against privacy/ and optim/
    "fedprivacy.devices": ("fedprivacy.config",),
    "fedprivacy.outputs": ("fedprivacy.config", "fedprivacy.locks", "fedprivacy.checkpoints", "fedprivacy.callbacks"),
    "fedprivacy.tfds_task": ("fedprivacy.config", "fedprivacy.data", "fedprivacy.client"),
    "fedprivacy.stackoverflow_tasks": ("fedprivacy.config", "fedprivacy.data", "fedprivacy.client", "fedprivacy.task",
                                       "fedprivacy.tfds_task"),
    "fedprivacy.tracking": ("fedprivacy.outputs",),  # TensorBoard and MLflow, imported when tracking is on
    "fedprivacy.fl": ("fedprivacy.stackoverflow_tasks", "fedprivacy.outputs", "fedprivacy.stopping",
                      "fedprivacy.tracking"),  # Flower
    "fedprivacy.flower_datasets": ("fedprivacy.data", "fedprivacy.client"),  # a Task over Flower Datasets partitions
    "fedprivacy.engines": ("fedprivacy.fl",),
    "fedprivacy.run": ("fedprivacy.engines", "fedprivacy.devices"),
    "fedprivacy.audit": ("fedprivacy.engines",),
    "fedprivacy.deploy": ("fedprivacy.fl",),
    "fedprivacy.experiments": ("fedprivacy.run",),
    "fedprivacy.cli": ("fedprivacy.experiments", "fedprivacy.audit", "fedprivacy.deploy", "fedprivacy.centralized"),
    "fedprivacy.__main__": ("fedprivacy.cli",),
    "fedprivacy": ("fedprivacy.cli", "fedprivacy.flower_datasets"),  # the package's own __init__: the public API, re-exported
}
FLOWER = ("flwr", "ray")
"""Only Flower's layer and those above it (the parts that may import fedprivacy.fl) may import these."""


def _modules() -> dict[str, Path]:
    return {".".join(p.relative_to(PACKAGE.parent).with_suffix("").parts).removesuffix(".__init__"): p
            for p in sorted(PACKAGE.rglob("*.py"))}


def _part(module: str) -> str | None:
    """The part of :data:`LAYERS` that ``module`` belongs to (the root ``fedprivacy`` holds its ``__init__`` only)."""
    if module == "fedprivacy":
        return module
    owners = [p for p in LAYERS if p != "fedprivacy" and (module == p or module.startswith(p + "."))]
    return max(owners, key=len) if owners else None


def _reachable(part: str) -> set[str]:
    seen, todo = {part}, [part]
    while todo:
        for below in LAYERS[todo.pop()]:
            if below not in seen:
                seen.add(below)
                todo.append(below)
    return seen


def _imports(path: Path) -> set[str]:
    names = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Import):
            names |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom):
            assert node.level == 0 and node.module, f"{path}: relative import"
            names.add(node.module)
    return names


def test_every_module_has_a_layer_and_every_layer_a_module():
    modules = _modules()
    assert not [m for m in modules if _part(m) is None]
    assert not [p for p in LAYERS if not any(_part(m) == p for m in modules)]


def test_layers_form_no_cycle():
    for part in LAYERS:
        assert not any(part in _reachable(below) for below in LAYERS[part]), part


@pytest.mark.parametrize("module", sorted(_modules()))
def test_a_module_imports_only_its_own_part_and_the_layers_below(module):
    part = _part(module)
    allowed = _reachable(part)
    may_use_flower = "fedprivacy.fl" in allowed
    bad = []
    for name in _imports(_modules()[module]):
        if name == "fedprivacy" or name.startswith("fedprivacy."):
            if _part(name) not in allowed:
                bad.append(name)
        elif name.split(".")[0] in FLOWER and not may_use_flower:
            bad.append(name)
    assert not sorted(bad)


def _module_graph() -> dict[str, set[str]]:
    """Each fedprivacy module -> the fedprivacy modules it imports at module level (imports inside functions
    and under ``TYPE_CHECKING`` are lazy)."""
    modules = _modules()
    graph = {}
    for name, path in modules.items():
        deps = set()
        for node in ast.parse(path.read_text()).body:
            targets = ([a.name for a in node.names] if isinstance(node, ast.Import)
                       else [node.module] + [f"{node.module}.{a.name}" for a in node.names]
                       if isinstance(node, ast.ImportFrom) and node.module else [])
            deps |= {t for t in targets if t in modules and t != name}
        graph[name] = deps
    return graph


def test_no_import_cycle_between_modules():
    """Module-level imports among fedprivacy's modules form no cycle."""
    graph = _module_graph()
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


APPLICATION = ("fedprivacy.config", "fedprivacy.outputs", "fedprivacy.devices", "fedprivacy.stackoverflow_tasks",
               "fedprivacy.data", "fedprivacy.run", "fedprivacy.experiments", "fedprivacy.cli")
"""The layers of ``fedprivacy run`` (the typed config and what reads it, the run folder, the StackOverflow data)."""


def test_the_strategy_imports_no_application_layer():
    """``fedprivacy.DPFedAvg`` (:mod:`fedprivacy.fl.strategy`) reaches, through module-level imports, no part of
    :data:`APPLICATION` (the path to one is named); ``tests/test_public_api.py`` checks the loaded modules."""
    graph = _module_graph()
    paths = {"fedprivacy.fl.strategy": ["fedprivacy.fl.strategy"]}
    todo = ["fedprivacy.fl.strategy"]
    while todo:
        module = todo.pop()
        for dep in graph[module] - set(paths):
            paths[dep] = paths[module] + [dep]
            todo.append(dep)
    assert not [" -> ".join(path) for m, path in sorted(paths.items()) if _part(m) in APPLICATION
                or any(m.startswith(a + ".") for a in APPLICATION)]
