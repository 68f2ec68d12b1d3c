"""A study's tables, built only from what its runs stored (nothing is rerun).

- ``rounds``: the tidy table, one row per run and round: the run's identity (run_id, method,
  budget, seed, grid point as ``hp.<field>`` columns) and every ``metrics.csv`` column.
- ``runs``: one row per run: final and best headline metric, the selection score, epsilon under
  every accountant, noise multiplier, wall time, and the canary estimates of runs with ``privacy.canaries``
  (``canary_*``, :func:`~fedprivacy.experiments.canary_report.estimate_columns`; NaN without).
- ``grid``: one row per method x budget x grid point: mean and std over seeds, and which point
  the selection rule picked (on the runs' logged metric, or with ``selection.split: heldout`` on
  each final model's metric over the held-out users, :mod:`fedprivacy.experiments.heldout`).
- ``summary``: the picked point of each method x budget.

Epsilon in ``runs``/``summary`` (and the epsilon-per-round curves, :func:`epsilon_curves`) is
computed from each run's own privacy ledger (``ledger.json``, extracted once from ``checkpoint.pt``)
under rdp, prv and pld, whichever accountants the run tracked per round (the tidy table keeps those
per-round columns as the run wrote them); identical ledgers are accounted once. ``std`` is the sample standard deviation over
seeds (NaN for one seed).
"""

from __future__ import annotations

import functools
import json
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd

from fedprivacy.config import build_config
from fedprivacy.experiments.canary_report import estimate_columns
from fedprivacy.experiments.heldout import heldout_metrics
from fedprivacy.experiments.study import (TASK_METRICS, StudyConfig, better, build_study, hparams_label,
                                          selection_rule, study_metric)
from fedprivacy.experiments.sweep import ERROR_FILE, RUN_RECORD, read_manifest, read_summary, run_state

ACCOUNTANTS = ("rdp", "prv", "pld")
WALL_COLUMNS = ("seconds", "train_seconds", "wall_seconds")
"""Columns that measure time: they differ between two otherwise identical sweeps."""
LEDGER = "ledger.json"
ID_COLUMNS = ("run_id", "method", "budget", "budget_epsilon", "seed", "hparams")


@dataclass
class StudyResults:
    """The tables of one study folder (see the module docstring)."""

    folder: Path
    """The study's output folder (where it lies now)."""
    study: StudyConfig
    metric: str
    selection: tuple[str, str, str]
    """(metric, mode, at) of the grid selection."""
    manifest: dict[str, Any]
    rounds: pd.DataFrame
    runs: pd.DataFrame
    grid: pd.DataFrame
    summary: pd.DataFrame
    ledgers: dict[str, tuple[str, float]]
    """run_id -> (ledger state as JSON, delta) of each finished run with a ledger."""

    @property
    def baseline_applies(self) -> bool:
        """Whether the runs' ``majority_baseline`` is of the headline metric (the task's own metric)."""
        return self.metric == TASK_METRICS.get(self.manifest["runs"][0]["config"]["data"]["task"], "test_accuracy")

    @property
    def incomplete(self) -> list[str]:
        return self.runs.loc[~self.runs["finished"], "run_id"].tolist()

    @property
    def failed(self) -> list[str]:
        return self.runs.loc[self.runs["failed"], "run_id"].tolist()


def _hp_value(values: list[Any]) -> list[Any]:
    """A grid column as numbers when every value is one (NaN where a method has no such grid key),
    else as text (Parquet needs one type per column)."""
    if all(v is None or (isinstance(v, (int, float)) and not isinstance(v, bool)) for v in values):
        return [math.nan if v is None else float(v) for v in values]
    return [None if v is None else v if isinstance(v, str) else json.dumps(v) for v in values]


def run_ledger(folder: Path) -> dict[str, Any] | None:
    """The run's privacy ledger state (``ledger.json``, written from ``checkpoint.pt`` on first use)."""
    path = folder / LEDGER
    if path.exists():
        return json.loads(path.read_text())
    if not (folder / "checkpoint.pt").exists():
        return None
    import torch

    state = torch.load(folder / "checkpoint.pt", weights_only=False, mmap=True, map_location="cpu")["ledger"]
    path.write_text(json.dumps(state))
    return state


@functools.lru_cache(maxsize=1024)
def _epsilons(ledger_json: str, delta: float, rounds: int) -> dict[str, float]:
    """Epsilon under every accountant after the ledger's first ``rounds`` rounds (cached: the final
    value of a run and the last point of its curve are one computation)."""
    from fedprivacy.privacy.accounting import PrivacyLedger, epsilons

    entries, left = [], rounds
    for rnd, count in PrivacyLedger.from_state_dict(json.loads(ledger_json)).entries:
        take = min(count, left)
        if take > 0:
            entries.append((rnd, take))
        left -= take
    return {k: (math.nan if v is None else float(v)) for k, v in epsilons(entries, delta, ACCOUNTANTS).items()}


def epsilon_curves(results: StudyResults, run_ids: list[str], points: int = 12) -> pd.DataFrame:
    """Epsilon under every accountant against the round, from the runs' ledgers, at about ``points``
    rounds per run (identical ledgers are accounted once): columns run_id, round, epsilon_<kind>."""
    rows = []
    for rid in run_ids:
        if rid not in results.ledgers:
            continue
        ledger_json, delta = results.ledgers[rid]
        total = _ledger_rounds(ledger_json)
        for t in sorted({int(round(x)) for x in np.linspace(1, total, min(points, total))}):
            rows.append({"run_id": rid, "round": t, **{f"epsilon_{k}": v for k, v in _epsilons(ledger_json, delta, t).items()}})
    return pd.DataFrame(rows, columns=["run_id", "round", *[f"epsilon_{k}" for k in ACCOUNTANTS]])


def _ledger_rounds(ledger_json: str) -> int:
    return sum(e["count"] for e in json.loads(ledger_json)["entries"])


def read_metrics(folder: Path) -> pd.DataFrame:
    """A run's ``metrics.csv`` (no rows: none yet, or a live run rewriting it for new columns at this moment).

    Raises:
        ValueError: the file is not a table, naming it.
    """
    path = folder / "metrics.csv"
    try:
        return pd.read_csv(path)
    except (FileNotFoundError, pd.errors.EmptyDataError):
        return pd.DataFrame()
    except (pd.errors.ParserError, UnicodeDecodeError) as err:
        raise ValueError(f"{path}: not a metrics table ({err})") from None


def _final(series: pd.Series) -> float:
    values = series.dropna()
    return float(values.iloc[-1]) if len(values) else math.nan


def _best(series: pd.Series, mode: str) -> float:
    values = series.dropna()
    if not len(values):
        return math.nan
    return float(values.max() if mode == "max" else values.min())


def _last_rounds_mean(metrics: pd.DataFrame, column: str, last: int) -> float:
    """Mean of ``column`` over the last ``last`` rounds of ``metrics`` (NaN rows skipped; NaN if none)."""
    if column not in metrics or not len(metrics):
        return math.nan
    values = metrics.loc[metrics["round"] > metrics["round"].max() - last, column].dropna()
    return float(values.mean()) if len(values) else math.nan


def _wall_seconds(folder: Path) -> float:
    try:
        attempts = json.loads((folder / RUN_RECORD).read_text())["attempts"]
    except (OSError, ValueError, KeyError):
        return math.nan
    known = [a["wall_seconds"] for a in attempts if a.get("wall_seconds") is not None]
    return float(sum(known)) if known else math.nan


def load_results(output_dir: str | Path) -> StudyResults:
    """Build every table of the study in ``output_dir`` from its stored runs."""
    output_dir = Path(output_dir)
    man = read_manifest(output_dir)
    study = build_study(man["study"], source=str(output_dir / "study.json"))
    metric = study_metric(study, man["runs"][0]["config"]["data"]["task"])
    sel_metric, mode, at = selection_rule(study, metric)
    budget_eps = {b.name: (b.epsilon if b.epsilon is not None else math.nan) for b in study.budgets}
    hp_keys = list(dict.fromkeys(k for r in man["runs"] for k in r["hparams"]))

    frames, rows, ledgers = [], [], {}
    for r in man["runs"]:
        folder = output_dir / "runs" / r["run_id"]
        ident = {"run_id": r["run_id"], "method": r["method"], "budget": r["budget"],
                 "budget_epsilon": budget_eps.get(r["budget"], math.nan), "seed": r["seed"],
                 "hparams": hparams_label(r["hparams"])}
        summary = read_summary(folder) if run_state(folder) == "finished" else None
        metrics = read_metrics(folder)
        row: dict[str, Any] = {**ident, **{f"hp.{k}": r["hparams"].get(k) for k in hp_keys},
                               "finished": summary is not None, "failed": (folder / ERROR_FILE).exists()}
        if len(metrics):
            frames.append(metrics.assign(**{k: v for k, v in row.items() if k not in ("failed",)}))
        row.update(rounds_completed=summary["rounds_completed"] if summary else len(metrics),
                   stop_reason=summary.get("stop_reason") if summary else None,
                   noise_multiplier=summary.get("noise_multiplier") if summary else math.nan,
                   delta=summary.get("delta") if summary else math.nan,
                   majority_baseline=summary.get("majority_baseline_accuracy") if summary else math.nan)
        col = metrics.get(metric, pd.Series(dtype=float))
        row[f"final_{metric}"] = _final(col)
        row[f"best_{metric}"] = _best(col, better(metric))
        row["final_test_loss"] = _final(metrics.get("test_loss", pd.Series(dtype=float)))
        if study.selection.split == "heldout":
            row["selection_score"] = (heldout_metrics(folder, build_config(r["config"], source=r["run_id"]),
                                                      study.selection.heldout_clients)[sel_metric]
                                      if summary is not None else math.nan)
        else:
            sel = metrics.get(sel_metric, pd.Series(dtype=float))
            row["selection_score"] = _final(sel) if at == "final" else _best(sel, mode)
        for spec in study.columns:
            row[spec.name] = _last_rounds_mean(metrics, spec.column, spec.last_rounds)
        eps = {k: math.nan for k in ACCOUNTANTS}
        if summary is not None:
            ledger = run_ledger(folder)
            if ledger is not None:
                ledgers[r["run_id"]] = ledger_json, delta = json.dumps(ledger, sort_keys=True), float(summary["delta"])
                eps = _epsilons(ledger_json, delta, _ledger_rounds(ledger_json))
            else:  # no checkpoint: the per-round columns the run tracked
                eps = {k: float(summary.get(f"epsilon_{k}", math.nan)) for k in ACCOUNTANTS}
        row.update({f"epsilon_{k}": v for k, v in eps.items()})
        row.update(estimate_columns(summary))
        row["train_seconds"] = float(metrics["seconds"].sum()) if "seconds" in metrics else math.nan
        row["wall_seconds"] = _wall_seconds(folder)
        rows.append(row)

    runs = pd.DataFrame(rows)
    for k in hp_keys:
        runs[f"hp.{k}"] = _hp_value(runs[f"hp.{k}"].tolist())
    lead = [c for c in runs.columns if c in ID_COLUMNS or c.startswith("hp.") or c == "finished"]
    tidy = pd.concat(frames, ignore_index=True) if frames else pd.DataFrame(columns=lead)
    for k in hp_keys:
        if f"hp.{k}" in tidy:
            tidy[f"hp.{k}"] = _hp_value(tidy[f"hp.{k}"].tolist())
    tidy = tidy[lead + [c for c in tidy.columns if c not in lead]]
    extra = [spec.name for spec in study.columns]
    grid = _grid(runs, metric, mode, extra)
    summary = _summary(runs, grid, metric, extra)
    return StudyResults(output_dir, study, metric, (sel_metric, mode, at), man, tidy, runs, grid, summary, ledgers)


def _grid(runs: pd.DataFrame, metric: str, mode: str, extra: list[str] = ()) -> pd.DataFrame:
    """One row per method x budget x grid point: mean and std over seeds of the final and best metric,
    the selection score and every ``extra`` column, and whether the selection picked the point."""
    done = runs[runs["finished"]]
    keys = ["method", "budget", "hparams"]
    if not len(done):
        return pd.DataFrame(columns=keys + ["n_seeds", "selected"])
    g = done.groupby(keys, sort=False)
    stats = {f"{c}_{s}": (c, s) for c in extra for s in ("mean", "std")}
    grid = g.agg(n_seeds=("seed", "size"),
                 final_mean=(f"final_{metric}", "mean"), final_std=(f"final_{metric}", "std"),
                 best_mean=(f"best_{metric}", "mean"), best_std=(f"best_{metric}", "std"),
                 score_mean=("selection_score", "mean"), score_std=("selection_score", "std"), **stats).reset_index()
    grid = grid.rename(columns={"final_mean": f"final_{metric}_mean", "final_std": f"final_{metric}_std",
                                "best_mean": f"best_{metric}_mean", "best_std": f"best_{metric}_std"})
    grid["selected"] = False
    for _, cell in grid.groupby(["method", "budget"], sort=False):
        scores = cell["score_mean"]
        if scores.notna().any():
            grid.loc[scores.idxmax() if mode == "max" else scores.idxmin(), "selected"] = True
    return grid


def _summary(runs: pd.DataFrame, grid: pd.DataFrame, metric: str, extra: list[str] = ()) -> pd.DataFrame:
    picked = grid[grid["selected"]]
    out = []
    for _, cell in picked.iterrows():
        sel = runs[runs["finished"] & (runs["method"] == cell["method"]) & (runs["budget"] == cell["budget"])
                   & (runs["hparams"] == cell["hparams"])]
        n_points = int(((grid["method"] == cell["method"]) & (grid["budget"] == cell["budget"])).sum())
        out.append({"method": cell["method"], "budget": cell["budget"], "budget_epsilon": sel["budget_epsilon"].iloc[0],
                    "hparams": cell["hparams"], "grid_points": n_points, "n_seeds": int(cell["n_seeds"]),
                    f"final_{metric}_mean": cell[f"final_{metric}_mean"], f"final_{metric}_std": cell[f"final_{metric}_std"],
                    f"best_{metric}_mean": cell[f"best_{metric}_mean"], f"best_{metric}_std": cell[f"best_{metric}_std"],
                    "selection_score_mean": cell["score_mean"], "selection_score_std": cell["score_std"],
                    **{f"{c}_{s}": cell[f"{c}_{s}"] for c in extra for s in ("mean", "std")},
                    **{f"epsilon_{k}": sel[f"epsilon_{k}"].mean() for k in ACCOUNTANTS},
                    "noise_multiplier": sel["noise_multiplier"].mean(), "rounds": sel["rounds_completed"].mean(),
                    "majority_baseline": sel["majority_baseline"].mean(),
                    "train_seconds_mean": sel["train_seconds"].mean(), "wall_seconds_mean": sel["wall_seconds"].mean()})
    return pd.DataFrame(out)


def write_tables(results: StudyResults, folder: Path) -> dict[str, Path]:
    """Each table as Parquet and CSV in ``folder``; returns name -> CSV path."""
    folder.mkdir(parents=True, exist_ok=True)
    written = {}
    for name in ("rounds", "runs", "grid", "summary"):
        df: pd.DataFrame = getattr(results, name)
        df.to_parquet(folder / f"{name}.parquet", index=False)
        df.to_csv(folder / f"{name}.csv", index=False)
        written[name] = folder / f"{name}.csv"
    return written


def without_wall_time(df: pd.DataFrame) -> pd.DataFrame:
    """``df`` without the time columns (:data:`WALL_COLUMNS`), for comparing two sweeps."""
    return df.drop(columns=[c for c in df.columns if c in WALL_COLUMNS or c.endswith("_seconds_mean")])
