"""Result tables in the docs, generated from studies' stored summaries (so they cannot drift).

A study's results are reduced to a small summary committed with the docs, ``docs/results/<name>.json``
(:func:`export_summary`, ``fedprivacy report DIR --summary docs/results/<name>.json``): the study's
metric and selection rule, and one record per finished run (method, budget, grid point, seed, final
and best metric, selection score, epsilon under every accountant, the study's extra ``columns``).
A Markdown file marks where each table goes:

.. code-block:: text

    <!-- table:NAME -->          the selected setting of each method x budget (NAME.json)
    ...generated, do not edit...
    <!-- /table:NAME -->
    <!-- table:NAME:grid -->     every grid point
    <!-- /table:NAME:grid -->
    <!-- table:NAME:verdict -->  per budget: which method is best, by how much, and whether that exceeds the seeds' spread
    <!-- /table:NAME:verdict -->
    <!-- table:NAME:canaries --> one run's canary estimates (NAME.json: a run's stored summary,
    <!-- /table:NAME:canaries --> fedprivacy.experiments.canary_report)

:func:`render_docs` regenerates every marked block from the summaries (``fedprivacy report --docs
FILE...``), and ``fedprivacy report --docs FILE... --check`` (and the test suite) fails when a file
differs from what its summaries give, e.g. after a hand edit of a number. The selection and the mean ±
sample std over seeds are recomputed from the per-run records by the same code as a study's own
report (:func:`fedprivacy.experiments.results._grid` and ``_summary``).
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pandas as pd

from fedprivacy.experiments.canary_report import load_run_summary, render_canary_table
from fedprivacy.experiments.results import ACCOUNTANTS, StudyResults, _grid, _summary
from fedprivacy.config import ConfigError
from fedprivacy.experiments.study import StudyConfig, column_title, expand_grid, hparams_label

SUMMARY_VERSION = 1
RUN_FIELDS = ("method", "budget", "budget_epsilon", "hparams", "seed", "rounds_completed", "noise_multiplier",
              "majority_baseline", "selection_score", *(f"epsilon_{k}" for k in ACCOUNTANTS))
"""Per-run fields of a stored summary (besides the final/best metric and the extra columns)."""
MARKER = re.compile(r"<!-- table:(?P<name>[\w.-]+?)(?::(?P<kind>grid|verdict|canaries))? -->\n(?P<body>.*?)"
                    r"<!-- /table:(?P=name)(?::(?P=kind))? -->", re.S)


class DocsTableError(ValueError):
    """A marked table names a summary that does not exist, or a docs file differs from its summaries."""


@dataclass(frozen=True)
class StoredSummary:
    """A study's stored summary: its metric, selection rule, extra columns and per-run records."""

    name: str
    study: str
    metric: str
    selection: dict[str, Any]
    """metric, mode, at, split, heldout_clients (as in the study's report)."""
    columns: list[str]
    runs: pd.DataFrame

    def grid(self) -> pd.DataFrame:
        return _grid(self.runs, self.metric, self.selection["mode"], self.columns)

    def summary(self) -> pd.DataFrame:
        return _summary(self.runs, self.grid(), self.metric, self.columns)


def _json_value(v: Any) -> Any:
    if isinstance(v, float) and math.isnan(v):
        return None
    return v.item() if hasattr(v, "item") else v


def export_summary(results: StudyResults, path: str | Path) -> Path:
    """Write the study's summary (finished runs only, in the study's order) as JSON to ``path``; returns it."""
    metric, mode, at = results.selection
    columns = [spec.name for spec in results.study.columns]
    done = results.runs[results.runs["finished"]]  # the study's order: method, budget, grid point, seed
    fields = [*RUN_FIELDS, f"final_{results.metric}", f"best_{results.metric}", *columns]
    records = [{f: _json_value(row[f]) for f in fields} for _, row in done.iterrows()]
    payload = {"version": SUMMARY_VERSION, "study": results.study.name, "metric": results.metric,
               "selection": {"metric": metric, "mode": mode, "at": at, "split": results.study.selection.split,
                             "heldout_clients": results.study.selection.heldout_clients},
               "columns": columns, "runs": records}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return path


def load_summary(path: str | Path) -> StoredSummary:
    """Read a summary written by :func:`export_summary`."""
    path = Path(path)
    data = json.loads(path.read_text())
    if data.get("version") != SUMMARY_VERSION:
        raise DocsTableError(f"{path}: summary version {data.get('version')!r}, expected {SUMMARY_VERSION}")
    runs = pd.DataFrame(data["runs"])
    for col in runs.columns:  # null -> NaN in the numeric columns
        if col not in ("method", "budget", "hparams", "seed"):
            runs[col] = runs[col].astype(float)
    runs = runs.assign(finished=True, train_seconds=math.nan, wall_seconds=math.nan)
    return StoredSummary(path.stem, data["study"], data["metric"], data["selection"], data["columns"], runs)


def _num(v: float) -> str:
    return "-" if v is None or math.isnan(v) else f"{v:.3f}"


def _pm(mean: float, std: float) -> str:
    return _num(mean) + ("" if std is None or math.isnan(std) else f" ± {_num(std)}")


def _table(header: list[str], rows: list[list[str]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(cell.replace("|", "\\|") for cell in row) + " |" for row in rows]
    return "\n".join(lines)


def render_summary_table(s: StoredSummary) -> str:
    """The selected grid point of each method x budget, mean ± sample std over seeds, with the footer
    that states the selection rule and the majority baseline."""
    summ, m, sel = s.summary(), s.metric, s.selection
    header = ["method", "budget", "selected (of grid points)", "seeds", f"{sel['metric']} (selection)",
              f"final {m}", f"best {m}", *map(column_title, s.columns), "epsilon (rdp)"]
    rows = [[r["method"], r["budget"], f"{r['hparams']} (of {r['grid_points']})", str(r["n_seeds"]),
             _pm(r["selection_score_mean"], r["selection_score_std"]),
             _pm(r[f"final_{m}_mean"], r[f"final_{m}_std"]), _pm(r[f"best_{m}_mean"], r[f"best_{m}_std"]),
             *(_pm(r[f"{c}_mean"], r[f"{c}_std"]) for c in s.columns), f"{r['epsilon_rdp']:.2f}"]
            for _, r in summ.iterrows()]
    if sel["split"] == "heldout":
        where = "the final model on held-out users"
    else:
        where = "the runs' own evaluation split" + (" (the test split: optimistic)" if sel["metric"].startswith("test_")
                                                    else "")
    foot = (f"Generated from `docs/results/{s.name}.json` (study `{s.study}`) by `fedprivacy report --docs`; "
            f"do not edit. Selection per method and budget: the {'largest' if sel['mode'] == 'max' else 'smallest'} mean over "
            f"seeds of `{sel['metric']}` ({sel['at']}, {where}). Mean ± sample std over seeds.")
    base = summ["majority_baseline"].mean() if len(summ) else math.nan
    if not math.isnan(base):
        foot += f" Majority baseline ({m}): {_num(base)}."
    return _table(header, rows) + "\n\n" + foot + "\n"


def render_grid_table(s: StoredSummary) -> str:
    """Every grid point of every method x budget, with which one the selection picked."""
    g, m, sel = s.grid(), s.metric, s.selection
    header = ["method", "budget", "setting", "seeds", f"{sel['metric']} (selection)", f"final {m}",
              *map(column_title, s.columns), "selected"]
    rows = [[r["method"], r["budget"], r["hparams"], str(r["n_seeds"]), _pm(r["score_mean"], r["score_std"]),
             _pm(r[f"final_{m}_mean"], r[f"final_{m}_std"]), *(_pm(r[f"{c}_mean"], r[f"{c}_std"]) for c in s.columns),
             "yes" if r["selected"] else ""] for _, r in g.iterrows()]
    return _table(header, rows) + "\n\n" + f"Generated from `docs/results/{s.name}.json`; do not edit.\n"


CLEAR_MARGIN = 2.0
r"""A difference of two methods' means is called clear when it exceeds this many standard errors of the
difference over seeds, :math:`\sqrt{s_1^2/n_1 + s_2^2/n_2}` (sample stds :math:`s`, :math:`n` seeds each)."""


def _standard_error(a: pd.Series, b: pd.Series, m: str) -> float:
    """Standard error of the difference of two selected settings' mean ``final_m`` over seeds (NaN below 2 seeds)."""
    if min(a["n_seeds"], b["n_seeds"]) < 2:
        return math.nan
    return math.sqrt(a[f"final_{m}_std"] ** 2 / a["n_seeds"] + b[f"final_{m}_std"] ** 2 / b["n_seeds"])


def render_verdict_table(s: StoredSummary, reference: str | None = None) -> str:
    """Per budget, the question a comparison asks: the best method (largest mean final metric of its selected
    setting; smallest for a loss), its margin over the runner-up and over ``reference`` (default: the study's first
    method) with the standard error of each difference over seeds, whether the margin is clear
    (:data:`CLEAR_MARGIN` standard errors), and how far the best is above the majority baseline."""
    summ, m = s.summary(), s.metric
    sign = -1.0 if s.selection["mode"] == "min" and m.endswith("loss") else 1.0
    reference = reference if reference is not None else (summ["method"].iloc[0] if len(summ) else "")

    def versus(best: pd.Series, other: pd.Series | None) -> tuple[str, str]:
        if other is None:
            return "-", "-"
        margin = sign * (best[f"final_{m}_mean"] - other[f"final_{m}_mean"])
        se = _standard_error(best, other, m)
        verdict = ("unknown (one seed)" if math.isnan(se) else
                   "clear" if margin > CLEAR_MARGIN * se else "within the seeds' spread")
        return f"{other['method']}: +{_num(margin)}" + ("" if math.isnan(se) else f" (se {_num(se)})"), verdict

    rows = []
    for budget in dict.fromkeys(summ["budget"]):
        cells = summ[summ["budget"] == budget].sort_values(f"final_{m}_mean", ascending=sign < 0, kind="stable")
        best = cells.iloc[0]
        runner = versus(best, cells.iloc[1] if len(cells) > 1 else None)
        ref = cells[cells["method"] == reference]
        vs_ref = versus(best, ref.iloc[0]) if len(ref) and ref.iloc[0]["method"] != best["method"] else ("-", "-")
        above = sign * (best[f"final_{m}_mean"] - best["majority_baseline"])
        rows.append([budget, best["method"], _pm(best[f"final_{m}_mean"], best[f"final_{m}_std"]),
                     runner[0], runner[1], vs_ref[0], vs_ref[1], _num(above)])
    header = ["budget", "best method", f"final {m}", "runner-up: margin", "margin vs runner-up",
              f"{reference}: margin", f"margin vs {reference}", "above majority baseline"]
    foot = (f"Generated from `docs/results/{s.name}.json` by `fedprivacy report --docs`; do not edit. Each method at "
            f"its selected setting (the table `{s.name}`); a margin is clear when it exceeds {CLEAR_MARGIN:g} standard "
            "errors of the difference over seeds (se = sqrt(s1^2/n1 + s2^2/n2), sample stds).")
    return _table(header, rows) + "\n\n" + foot + "\n"


def render_docs(text: str, results_dir: str | Path) -> str:
    """``text`` with every marked table block regenerated from the summaries in ``results_dir``."""
    results_dir = Path(results_dir)

    def block(match: re.Match) -> str:
        name, kind = match["name"], match["kind"]
        path = results_dir / f"{name}.json"
        if not path.exists():
            raise DocsTableError(f"table {name!r}: no stored summary {path}")
        if kind == "canaries":
            body = render_canary_table(name, load_run_summary(path))
        else:
            s = load_summary(path)
            body = {"grid": render_grid_table, "verdict": render_verdict_table}.get(kind, render_summary_table)(s)
        tag = name + (f":{kind}" if kind else "")
        return f"<!-- table:{tag} -->\n{body}<!-- /table:{tag} -->"

    return MARKER.sub(block, text)


def marked_tables(text: str) -> list[str]:
    """The names of the marked blocks in ``text`` (``NAME`` or ``NAME:grid``)."""
    return [m["name"] + (f":{m['kind']}" if m["kind"] else "") for m in MARKER.finditer(text)]


def stale_tables(path: str | Path, results_dir: str | Path) -> list[str]:
    """The marked blocks of ``path`` whose text differs from what the summaries give (empty: up to date)."""
    text = Path(path).read_text()
    fresh = render_docs(text, results_dir)
    old, new = list(MARKER.finditer(text)), list(MARKER.finditer(fresh))
    return [o["name"] + (f":{o['kind']}" if o["kind"] else "") for o, n in zip(old, new) if o[0] != n[0]]


def update_docs(path: str | Path, results_dir: str | Path) -> bool:
    """Regenerate the marked blocks of ``path`` in place; returns whether the file changed."""
    path = Path(path)
    text = path.read_text()
    fresh = render_docs(text, results_dir)
    if fresh != text:
        path.write_text(fresh)
    return fresh != text


def tuned(study: StudyConfig) -> StudyConfig:
    """``study`` with each method's grid replaced by the single point that its ``tuned_on`` summary selected at
    ``tuned_on.budget`` (the largest/smallest mean selection score over seeds, as that study's report selects);
    ``study`` itself when it has no ``tuned_on``.

    Raises:
        ConfigError: the summary is missing, or a method has not run there at that budget, or not every point of
            its grid (a selection among fewer points would not be the one the grid asks for).
    """
    spec = study.tuned_on
    if spec is None:
        return study
    if not spec.summary.is_file():
        raise ConfigError(f"tuned_on.summary: {spec.summary} does not exist (run the tuning study and "
                          "`fedprivacy report DIR --summary FILE` first)")
    stored = load_summary(spec.summary)
    grid = stored.grid()
    methods = {}
    for name, method in study.methods.items():
        cells = grid[(grid["method"] == name) & (grid["budget"] == spec.budget)]
        points = {hparams_label(point): point for point in expand_grid(method.grid)}
        missing = sorted(set(points) - set(cells["hparams"]))
        if missing:
            raise ConfigError(f"tuned_on: {spec.summary} lacks method {name!r} at budget {spec.budget!r} for "
                              f"{len(missing)} of its {len(points)} grid points ({'; '.join(missing)}): finish the "
                              "tuning study first")
        chosen = points[cells[cells["selected"]]["hparams"].iloc[0]]
        methods[name] = method.model_copy(update={"grid": {key: [value] for key, value in chosen.items()}})
    return study.model_copy(update={"methods": methods})
