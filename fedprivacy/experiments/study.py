"""A comparison study: methods x privacy budgets x seeds x per-method hyperparameter grid.

A study YAML (see ``configs/study_*.yaml``) is parsed into :class:`StudyConfig`; ``--set key=value``
overrides address its fields with dots (``--set seeds=[0] --set base.rounds=5``). Unknown fields are
errors naming the field, as for a run config. :func:`expand` turns the study into one
:class:`RunSpec` per run, each holding a validated :class:`~fedprivacy.config.RunConfig`:

.. code-block:: text

    run config = base  <-  budget  <-  method.set  <-  one point of method.grid  <-  seed, output_dir

merged key by key (nested mappings merge, anything else replaces). A budget is either a target
epsilon (``privacy.noise_multiplier: auto``: each run calibrates z for its own rounds and sampling
when it starts) or a fixed noise multiplier. Methods may not touch the budget's fields, so every
method at one budget runs the same mechanism.

Run ids are deterministic, ``<method>__<budget>__<grid point>__s<seed>``, and name the run's folder
under ``<output_dir>/runs/``.
"""

from __future__ import annotations

import itertools
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator, model_validator

from fedprivacy.config import ConfigError, RunConfig, build_config, flat, read_yaml_mapping, validate_tree

TASK_METRICS = {"tag": "test_accuracy", "tag_multilabel": "test_recall_at_5", "next_word": "test_accuracy"}
"""The headline metric of each ``data.task`` (a column of ``metrics.csv``)."""

BUDGET_FIELDS = ("privacy.noise_multiplier", "privacy.target_epsilon")
"""Set by the study's budgets; a method that sets them would change the mechanism it is compared under."""


class _Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class BudgetSpec(_Section):
    """One privacy budget: a target epsilon (noise calibrated per run) or a fixed noise multiplier."""

    epsilon: float | None = Field(None, gt=0.0)
    """Target epsilon under ``privacy.budget_accountant`` after the run's ``rounds`` (``noise_multiplier: auto``)."""
    noise_multiplier: float | None = Field(None, ge=0.0)
    """A fixed z instead (0: no privacy, a non-private reference)."""
    label: str | None = None
    """Name in tables and run ids (default ``eps8`` or ``z0.3``)."""

    @model_validator(mode="after")
    def _exactly_one(self) -> BudgetSpec:
        if (self.epsilon is None) == (self.noise_multiplier is None):
            raise ValueError("a budget needs exactly one of epsilon (target, noise calibrated per run) or "
                             "noise_multiplier (fixed)")
        return self

    @property
    def name(self) -> str:
        if self.label:
            return self.label
        return f"eps{self.epsilon:g}" if self.epsilon is not None else f"z{self.noise_multiplier:g}"

    def overrides(self) -> dict[str, Any]:
        if self.epsilon is not None:
            return {"privacy": {"noise_multiplier": "auto", "target_epsilon": self.epsilon}}
        return {"privacy": {"noise_multiplier": self.noise_multiplier}}


class MethodSpec(_Section):
    """A method: run-config overrides on the base, and optionally a hyperparameter grid to tune."""

    set: dict[str, Any] = {}
    """RunConfig overrides, nested (``server: {optimizer: adam}``) or dotted (``server.optimizer: adam``)."""
    grid: dict[str, list[Any]] = {}
    """Dotted RunConfig field -> values; every combination is run (e.g. ``server.lr: [0.01, 0.1]``)."""
    description: str = ""

    @field_validator("grid", mode="before")
    @classmethod
    def _dotted_keys(cls, grid: Any) -> Any:
        """Nested grids (as ``--set methods.M.grid.server.lr=[...]`` writes them) become dotted keys."""
        if not isinstance(grid, dict):
            return grid
        flat: dict[str, Any] = {}
        for key, value in grid.items():
            if isinstance(value, dict):
                flat.update({f"{key}.{k}": v for k, v in cls._dotted_keys(value).items()})
            else:
                flat[str(key)] = value
        return flat

    @field_validator("grid")
    @classmethod
    def _non_empty_values(cls, grid: dict[str, list[Any]]) -> dict[str, list[Any]]:
        for key, values in grid.items():
            if not values:
                raise ValueError(f"grid.{key} has no values")
        return grid


class SelectionSpec(_Section):
    """How each method's grid point is picked per budget (mean over seeds of ``metric`` at ``at``)."""

    metric: str | None = None
    """A ``metrics.csv`` column; default: the study's metric. With ``split: heldout``, the test metric
    whose held-out counterpart is used (``test_accuracy`` -> ``heldout_accuracy``)."""
    mode: Literal["max", "min"] | None = None
    """Best is the largest or the smallest; default: min for losses, max otherwise."""
    at: Literal["final", "best"] = "final"
    """final: the last evaluated value of the run; best: the best value over its rounds."""
    split: Literal["test", "heldout"] = "test"
    """test: the metric as the run logged it (on its evaluation split); heldout: the run's final model
    evaluated on the data's held-out users (TFF's ``heldout`` split: users disjoint from the training and
    test users, :mod:`fedprivacy.experiments.heldout`), so the selection does not bias the test metric."""
    heldout_clients: int | None = Field(None, ge=1)
    """``split: heldout``: evaluate on the first this many held-out users (None: all of them)."""

    @model_validator(mode="after")
    def _heldout_is_final(self) -> SelectionSpec:
        if self.split == "heldout" and self.at != "final":
            raise ValueError("selection.at must be 'final' with selection.split=heldout (only the final model "
                             "is stored, so only it can be evaluated on held-out users)")
        if self.split == "test" and self.heldout_clients is not None:
            raise ValueError("selection.heldout_clients applies only with selection.split=heldout")
        return self


class ColumnSpec(_Section):
    """An extra per-run table column: the mean of a ``metrics.csv`` column over the run's last rounds
    (e.g. DP-FedAdamBC's ``adambc_floored_fraction``); averaged over seeds like the metric."""

    column: str
    """A ``metrics.csv`` column."""
    last_rounds: int = Field(1, ge=1)
    """Average over the rounds ``R - last_rounds + 1 .. R`` of a run that completed ``R`` rounds (NaN
    values, rounds where the column was not logged, are skipped)."""

    @property
    def name(self) -> str:
        """The column's name in the tables: ``<column>_last<last_rounds>``."""
        return f"{self.column}_last{self.last_rounds}"


def column_title(name: str) -> str:
    """A table header for the column named ``name`` (:attr:`ColumnSpec.name`), e.g.
    ``x (mean of last 10 rounds)`` or ``x (last round)``."""
    column, _, last = name.rpartition("_last")
    return f"{column} (last round)" if last == "1" else f"{column} (mean of last {last} rounds)"


class TunedSpec(_Section):
    """Hyperparameters tuned by an earlier study: each method runs the single grid point that study selected at
    one of its budgets (e.g. learning rates selected at epsilon 8 and one seed, then run at every budget and seed)."""

    summary: Path
    """That study's stored summary (``fedprivacy report DIR --summary FILE``), e.g. ``docs/results/NAME.json``."""
    budget: str
    """The budget (its label, e.g. ``eps8``) at which the selection is taken."""


class StudyConfig(_Section):
    """A comparison study (the YAML schema of ``fedprivacy compare``)."""

    name: str
    description: str = ""
    output_dir: Path
    base: dict[str, Any] = {}
    """RunConfig fields shared by every run (the setting); unset fields keep RunConfig's defaults."""
    methods: dict[str, MethodSpec] = Field(min_length=1)
    budgets: list[BudgetSpec] = Field(min_length=1)
    seeds: list[int] = Field([0], min_length=1)
    metric: str | None = None
    """Headline ``metrics.csv`` column; default from ``data.task`` (:data:`TASK_METRICS`)."""
    selection: SelectionSpec = SelectionSpec()
    tuned_on: TunedSpec | None = None
    """Take each method's grid point from an earlier study's selection (:class:`TunedSpec`): every method's
    ``grid`` must be that study's, completely run at ``tuned_on.budget``; this study then runs only the point
    selected there (:func:`fedprivacy.experiments.docs.tuned`, applied by :func:`fedprivacy.experiments.load_study`)."""
    columns: list[ColumnSpec] = []
    """Extra per-run columns of the tables (:class:`ColumnSpec`)."""

    @field_validator("seeds")
    @classmethod
    def _distinct_seeds(cls, seeds: list[int]) -> list[int]:
        if len(set(seeds)) != len(seeds):
            raise ValueError(f"seeds must be distinct, got {seeds}")
        return seeds

    @model_validator(mode="after")
    def _distinct_budget_names(self) -> StudyConfig:
        names = [b.name for b in self.budgets]
        if len(set(names)) != len(names):
            raise ValueError(f"budgets must have distinct labels, got {names}")
        return self


@dataclass(frozen=True)
class RunSpec:
    """One run of a study: where it goes and the validated config it runs."""

    run_id: str
    method: str
    budget: str
    seed: int
    hparams: dict[str, Any]
    """The grid point (dotted field -> value); empty when the method has no grid."""
    config: RunConfig

    @property
    def hparams_label(self) -> str:
        return hparams_label(self.hparams)


def hparams_label(hparams: dict[str, Any]) -> str:
    """A grid point as text (``server.lr=0.1, client.lr=3``; ``-`` for none)."""
    return ", ".join(f"{k}={v}" for k, v in hparams.items()) or "-"


def _slug(text: str) -> str:
    return re.sub(r"[^A-Za-z0-9._=-]+", "-", text).strip("-") or "x"


def nested(tree: dict[str, Any]) -> dict[str, Any]:
    """A mapping whose dotted keys (``server.lr``) are expanded into nested mappings."""
    out: dict[str, Any] = {}
    for key, value in tree.items():
        value = nested(value) if isinstance(value, dict) else value
        *parents, leaf = str(key).split(".")
        node = out
        for p in parents:
            node = node.setdefault(p, {})
        node[leaf] = merge(node[leaf], value) if isinstance(node.get(leaf), dict) and isinstance(value, dict) else value
    return out


def merge(base: dict[str, Any], over: dict[str, Any]) -> dict[str, Any]:
    """``over`` merged into a copy of ``base``: nested mappings merge, anything else replaces."""
    out = dict(base)
    for key, value in over.items():
        out[key] = merge(out[key], value) if isinstance(out.get(key), dict) and isinstance(value, dict) else value
    return out


def run_id(method: str, budget: str, hparams: dict[str, Any], seed: int) -> str:
    point = "_".join(f"{k}={v}" for k, v in hparams.items()) or "default"
    return "__".join(_slug(part) for part in (method, budget, point, f"s{seed}"))


def expand_grid(grid: dict[str, list[Any]]) -> list[dict[str, Any]]:
    """Every point of a method's grid (dotted field -> value), in order; ``[{}]`` for no grid."""
    return [dict(zip(grid, values)) for values in itertools.product(*grid.values())]


def study_tracking(study: StudyConfig) -> dict[str, Any]:
    """What a study's runs track into unless they say otherwise: ONE MLflow experiment named for the study, its
    store in ``<output_dir>/mlruns`` (each run's TensorBoard log is in its own folder, ``runs/<run_id>/tensorboard``)."""
    return {"tracking": {"experiment": study.name, "mlflow_uri": str(study.output_dir / "mlruns")}}


def expand(study: StudyConfig) -> list[RunSpec]:
    """Every run of the study, in order method, budget, grid point, seed (each config validated).

    Raises:
        ConfigError: a method touches the budget's fields, or a run's config is invalid; the message
            names the method, budget and grid point, and the field.
    """
    specs: list[RunSpec] = []
    base = nested(study.base)
    for method, spec in study.methods.items():
        overrides = nested(spec.set)
        touched = sorted((set(flat(overrides)) | set(spec.grid)) & set(BUDGET_FIELDS))
        if touched:
            raise ConfigError(f"methods.{method}: {', '.join(touched)} is set by the study's budgets "
                              "(every method at one budget runs the same mechanism)")
        points = expand_grid(spec.grid)
        for budget in study.budgets:
            for point in points:
                for seed in study.seeds:
                    rid = run_id(method, budget.name, point, seed)
                    tree = merge(merge(merge(base, budget.overrides()), overrides), nested(point))
                    tree = merge(tree, {"seed": seed, "output_dir": str(study.output_dir / "runs" / rid)})
                    if (tree.get("tracking") or {}).get("mlflow"):
                        tree = merge(study_tracking(study), tree)
                    where = f"methods.{method} at budget {budget.name}" + (f", grid point {point}" if point else "")
                    cfg = build_config(tree, source=where)
                    specs.append(RunSpec(rid, method, budget.name, seed, point, cfg))
    ids = [s.run_id for s in specs]
    if len(set(ids)) != len(ids):
        dup = sorted({i for i in ids if ids.count(i) > 1})
        raise ConfigError(f"methods: two runs get the same id {dup[0]!r} (method names or grid values that differ "
                          "only in characters a folder name cannot hold)")
    tasks = {s.config.data.task for s in specs}
    if len(tasks) > 1:
        raise ConfigError(f"methods: every run of a study must share data.task (got {sorted(tasks)})")
    return specs


def study_metric(study: StudyConfig, task: str) -> str:
    """The study's headline metric: ``metric`` or that of its ``data.task`` (:data:`TASK_METRICS`)."""
    return study.metric or TASK_METRICS.get(task, "test_accuracy")  # a user's task: test_accuracy


def better(metric: str) -> str:
    """Which way ``metric`` improves: ``min`` for a loss, else ``max``."""
    return "min" if metric.endswith("loss") else "max"


def heldout_name(metric: str) -> str:
    """The held-out counterpart of a test metric: ``test_accuracy`` -> ``heldout_accuracy``."""
    return "heldout_" + metric.removeprefix("test_")


def selection_rule(study: StudyConfig, metric: str) -> tuple[str, str, str]:
    """``(metric, mode, at)`` of the grid selection with the defaults filled in (with ``split: heldout``,
    the metric is the held-out one, e.g. ``heldout_accuracy``)."""
    sel_metric = study.selection.metric or metric
    if study.selection.split == "heldout":
        sel_metric = heldout_name(sel_metric)
    return sel_metric, study.selection.mode or better(sel_metric), study.selection.at


def build_study(tree: dict[str, Any], overrides: list[str] | tuple[str, ...] = (), source: str = "study") -> StudyConfig:
    """Validate a nested dict plus ``key=value`` overrides into a :class:`StudyConfig`."""
    return validate_tree(StudyConfig, tree, overrides, source, what="study")


def load_study(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> StudyConfig:
    """Read a study YAML file and apply overrides."""
    return build_study(read_yaml_mapping(path, what="study"), overrides, source=str(path))
