"""A study's figures (PNG and SVG), drawn from its tables only.

- ``metric_vs_round``: the headline metric against the round, one panel per budget, one line per
  method (its selected grid point; mean over seeds, band = +-1 std), majority baseline dashed.
- ``final_vs_epsilon``: final metric (mean +- std over seeds) against the epsilon actually spent
  (budget accountant), one line per method across budgets.
- ``epsilon_vs_round``: epsilon under rdp, prv and pld against the round, from the selected runs'
  privacy ledgers, per budget; one line per budget and accountant when every method's curve is the
  same (the usual case: server variants are post-processing of the same mechanism), else one per method.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd

from fedprivacy.experiments.results import ACCOUNTANTS, StudyResults, epsilon_curves

FORMATS = ("png", "svg")


def _transforms():
    from matplotlib import transforms

    return transforms


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, folder: Path, name: str) -> list[Path]:
    paths = []
    for ext in FORMATS:
        path = folder / f"{name}.{ext}"
        fig.savefig(path, dpi=130, bbox_inches="tight")
        paths.append(path)
    _plt().close(fig)
    return paths


def _integer_rounds(ax) -> None:
    from matplotlib.ticker import MaxNLocator

    ax.xaxis.set_major_locator(MaxNLocator(integer=True))


def selected_rounds(results: StudyResults) -> pd.DataFrame:
    """Rows of the tidy table that belong to each method's selected grid point (finished runs)."""
    if not len(results.summary) or not len(results.rounds):
        return results.rounds.iloc[0:0]
    keys = results.summary[["method", "budget", "hparams"]]
    return results.rounds[results.rounds["finished"].astype(bool)].merge(keys, on=["method", "budget", "hparams"])


def _methods(results: StudyResults) -> list[str]:
    return [m for m in results.study.methods if m in set(results.summary["method"])]


def _budgets(results: StudyResults) -> list[str]:
    return [b.name for b in results.study.budgets if b.name in set(results.summary["budget"])]


def _colors(names: list[str]) -> dict[str, object]:
    cmap = _plt().get_cmap("tab10" if len(names) <= 10 else "tab20")
    return {n: cmap(i % cmap.N) for i, n in enumerate(names)}


def metric_vs_round(results: StudyResults, folder: Path) -> list[Path]:
    plt = _plt()
    rows, metric = selected_rounds(results), results.metric
    budgets, methods = _budgets(results), _methods(results)
    colors = _colors(methods)
    fig, axes = plt.subplots(1, max(len(budgets), 1), figsize=(5.2 * max(len(budgets), 1), 4), sharey=True,
                             squeeze=False)
    for ax, budget in zip(axes[0], budgets):
        for method in methods:
            sub = rows[(rows["method"] == method) & (rows["budget"] == budget)].dropna(subset=[metric])
            if not len(sub):
                continue
            stats = sub.groupby("round")[metric].agg(["mean", "std"]).reset_index()
            ax.plot(stats["round"], stats["mean"], marker="o", ms=3, label=method, color=colors[method])
            if stats["std"].notna().any():
                ax.fill_between(stats["round"], stats["mean"] - stats["std"].fillna(0),
                                stats["mean"] + stats["std"].fillna(0), alpha=0.2, color=colors[method])
        base = results.summary.loc[results.summary["budget"] == budget, "majority_baseline"].mean()
        if results.baseline_applies and np.isfinite(base):
            ax.axhline(base, linestyle="--", color="gray", label="majority baseline")
        ax.set(title=f"budget {budget}", xlabel="round", ylabel=metric)
        _integer_rounds(ax)
        ax.grid(alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle(f"{results.study.name}: {metric} per round (mean over seeds, band +-1 std)")
    fig.tight_layout()
    return _save(fig, folder, "metric_vs_round")


def budget_accountant(results: StudyResults) -> str:
    return results.manifest["runs"][0]["config"]["privacy"]["budget_accountant"]


def final_vs_epsilon(results: StudyResults, folder: Path) -> list[Path]:
    plt, transforms = _plt(), _transforms()
    from matplotlib.ticker import NullFormatter

    s, metric, acct = results.summary, results.metric, budget_accountant(results)
    methods = _methods(results)
    colors = _colors(methods)
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    eps_all = s[f"epsilon_{acct}"].replace([np.inf], np.nan).dropna()
    spread = eps_all.max() / eps_all.min() if len(eps_all) and eps_all.min() > 0 else 1.0
    for i, method in enumerate(methods):
        sub = s[(s["method"] == method) & np.isfinite(s[f"epsilon_{acct}"])].sort_values(f"epsilon_{acct}")
        if not len(sub):
            continue
        # methods share each epsilon: draw them a few points apart on screen, at their exact epsilon
        shift = transforms.offset_copy(ax.transData, fig=fig, x=4.0 * (i - (len(methods) - 1) / 2), units="points")
        ax.errorbar(sub[f"epsilon_{acct}"], sub[f"final_{metric}_mean"], yerr=sub[f"final_{metric}_std"],
                    marker="o", capsize=3, label=method, color=colors[method], transform=shift)
    for _, row in s[~np.isfinite(s[f"epsilon_{acct}"])].iterrows():  # no-noise references: epsilon is infinite
        ax.axhline(row[f"final_{metric}_mean"], linestyle=":", color=colors.get(row["method"], "black"),
                   label=f"{row['method']}, {row['budget']} (epsilon = inf)")
    # artists drawn with an offset transform do not update the data limits: set them from the data
    ys = pd.concat([s[f"final_{metric}_mean"] - s[f"final_{metric}_std"].fillna(0),
                    s[f"final_{metric}_mean"] + s[f"final_{metric}_std"].fillna(0), s["majority_baseline"]
                    if results.baseline_applies else pd.Series(dtype=float)]).replace([np.inf, -np.inf], np.nan).dropna()
    if len(ys):
        pad = 0.08 * max(ys.max() - ys.min(), 1e-3)
        ax.set_ylim(ys.min() - pad, ys.max() + pad)
    if len(eps_all):
        ticks = sorted(set(np.round(eps_all.to_numpy(dtype=float), 2)))
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.set_xlim(min(ticks) / 1.5, max(ticks) * 1.5)
    base = s["majority_baseline"].mean()
    if results.baseline_applies and np.isfinite(base):
        ax.axhline(base, linestyle="--", color="gray", label="majority baseline")
    if spread > 5:
        ax.set_xscale("log")
        ax.set_xticks(ticks, [f"{t:g}" for t in ticks])
        ax.xaxis.set_minor_formatter(NullFormatter())
    ax.set(xlabel=f"epsilon ({acct}, delta as in each run)", ylabel=f"final {metric}",
           title=f"{results.study.name}: final {metric} vs privacy (mean +- std over seeds)")
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, folder, "final_vs_epsilon")


def selected_epsilon_curves(results: StudyResults) -> pd.DataFrame:
    """Epsilon per round under every accountant (from the ledgers) of each method's selected runs:
    columns budget, method, round, epsilon_<kind> (mean over the seeds' runs)."""
    rows = selected_rounds(results)[["run_id", "method", "budget"]].drop_duplicates()
    curves = epsilon_curves(results, rows["run_id"].tolist())
    if not len(curves):
        return pd.DataFrame(columns=["budget", "method", "round", *[f"epsilon_{k}" for k in ACCOUNTANTS]])
    merged = curves.merge(rows, on="run_id")
    return merged.groupby(["budget", "method", "round"], sort=False)[[f"epsilon_{k}" for k in ACCOUNTANTS]] \
        .mean().reset_index()


def epsilon_vs_round(results: StudyResults, folder: Path, curves: pd.DataFrame | None = None) -> list[Path]:
    plt = _plt()
    curves = selected_epsilon_curves(results) if curves is None else curves
    fig, ax = plt.subplots(figsize=(6.5, 4.2))
    colors = _colors(_budgets(results))
    styles = {"rdp": "-", "prv": "--", "pld": ":"}
    for budget in _budgets(results):
        cell = curves[curves["budget"] == budget]
        per_method = {m: c.set_index("round") for m, c in cell.groupby("method", sort=False)}
        if not per_method:
            continue
        first = next(iter(per_method.values()))
        same = all(c.index.equals(first.index) and np.allclose(c.filter(like="epsilon_").to_numpy(dtype=float),
                                                               first.filter(like="epsilon_").to_numpy(dtype=float),
                                                               rtol=1e-9, equal_nan=True) for c in per_method.values())
        items = [("all methods", first)] if same else list(per_method.items())
        for who, c in items:
            for acct in ACCOUNTANTS:
                if c[f"epsilon_{acct}"].notna().any():
                    ax.plot(c.index, c[f"epsilon_{acct}"], linestyle=styles[acct], marker=".", color=colors[budget],
                            label=f"{budget} ({who}), {acct}")
    ax.set(xlabel="round", ylabel="epsilon", title=f"{results.study.name}: privacy spent per round")
    _integer_rounds(ax)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=8)
    fig.tight_layout()
    return _save(fig, folder, "epsilon_vs_round")


def write_figures(results: StudyResults, folder: Path, curves: pd.DataFrame | None = None) -> dict[str, list[Path]]:
    """Every figure as PNG and SVG in ``folder``; returns name -> paths. ``curves``:
    :func:`selected_epsilon_curves`, when the caller has it already."""
    folder.mkdir(parents=True, exist_ok=True)
    if not len(results.summary):
        return {}
    return {"metric_vs_round": metric_vs_round(results, folder),
            "final_vs_epsilon": final_vs_epsilon(results, folder),
            "epsilon_vs_round": epsilon_vs_round(results, folder, curves)}
