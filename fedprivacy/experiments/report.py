"""The study report: tables, figures and ``report.md`` regenerated from a study folder's stored runs.

``fedprivacy report DIR`` (and the end of every ``fedprivacy compare``) calls :func:`write_report`;
nothing is rerun. The report states the privacy budget of each cell (and checks, from the runs'
ledgers, that every method at one budget spent the same epsilon), the selected setting of each
method with mean and std over seeds, the selection rule and its caveat, the whole grid, the figures
and the resolved configurations (what every selected run shares, then what each method changes).
"""

from __future__ import annotations

import math
from pathlib import Path
from typing import Any

import numpy as np
import pandas as pd
import yaml

from fedprivacy.experiments.canary_report import SCORES
from fedprivacy.experiments.figures import budget_accountant, selected_epsilon_curves, write_figures
from fedprivacy.experiments.results import ACCOUNTANTS, StudyResults, load_results, write_tables
from fedprivacy.experiments.study import column_title, flat, nested
from fedprivacy.experiments.sweep import results_config

REPORT = "report.md"
VARYING = ("seed", "output_dir")
"""Config fields that differ between runs of one setting by construction (not shown as differences)."""


def _fmt(v: Any) -> str:
    if isinstance(v, (float, np.floating)):
        if math.isnan(v):
            return "-"
        return "inf" if math.isinf(v) else f"{v:.4g}"
    return str(v)


def _pm(mean: float, std: float) -> str:
    return _fmt(mean) + ("" if isinstance(std, float) and math.isnan(std) else f" ± {_fmt(std)}")


def markdown_table(df: pd.DataFrame) -> str:
    """``df`` as a GitHub Markdown table (floats to 4 significant digits, NaN as "-")."""
    head = "| " + " | ".join(str(c) for c in df.columns) + " |"
    rule = "|" + "---|" * len(df.columns)
    body = ["| " + " | ".join(_fmt(v).replace("|", "\\|") for v in row) + " |" for row in df.itertuples(index=False)]
    return "\n".join([head, rule, *body])


def _resolved(results: StudyResults, run_id: str) -> dict[str, Any]:
    """The run's resolved config (its config.yaml: calibrated z filled in), else the manifest's."""
    path = results.folder / "runs" / run_id / "config.yaml"
    if path.exists():
        return yaml.safe_load(path.read_text())
    return next(r["config"] for r in results.manifest["runs"] if r["run_id"] == run_id)


def _selected_run_ids(results: StudyResults) -> dict[tuple[str, str], str]:
    runs = results.runs[results.runs["finished"]]
    out = {}
    for _, s in results.summary.iterrows():
        sel = runs[(runs["method"] == s["method"]) & (runs["budget"] == s["budget"]) & (runs["hparams"] == s["hparams"])]
        out[(s["method"], s["budget"])] = sel.sort_values("seed")["run_id"].iloc[0]
    return out


def _setting_lines(results: StudyResults) -> list[str]:
    cfg = results.manifest["runs"][0]["config"]
    d, p, c = cfg["data"], cfg["privacy"], cfg["client"]
    budgets = ", ".join(f"{b.name} (" + (f"target epsilon {b.epsilon:g}, z calibrated per run" if b.epsilon is not None
                                          else f"noise multiplier {b.noise_multiplier:g}") + ")"
                        for b in results.study.budgets)
    n = len(results.runs)
    return [
        f"- Task `{d['task']}`, metric `{results.metric}`; data `{d['path']}` ({d['source']}, view `{d['view']}`, "
        f"synthetic users generated if missing: {d['synthetic_clients']}).",
        f"- {cfg['rounds']} rounds, evaluation every {cfg['eval_every']}; cohort {p['expected_cohort']} "
        f"({p['sampling']} sampling), delta {'1/population' if p['delta'] is None else p['delta']}; clients: "
        f"{c['epochs']} epoch(s), batch {c['batch_size']} (method settings below).",
        f"- Budgets: {budgets}. Seeds: {results.study.seeds}. Methods: {len(results.study.methods)}; "
        f"runs: {n} ({int(results.runs['finished'].sum())} finished"
        + (f", {len(results.failed)} failed" if results.failed else "")
        + (f", {len(results.incomplete)} not finished" if results.incomplete else "") + ").",
    ]


def _privacy_lines(results: StudyResults) -> list[str]:
    s = results.summary
    acct = budget_accountant(results)
    lines = [f"Epsilon of each selected setting under every accountant, computed from the runs' own privacy "
             f"ledgers (budget accountant: `{acct}`):", ""]
    table = s[["method", "budget", "noise_multiplier", "rounds", *[f"epsilon_{k}" for k in ACCOUNTANTS]]]
    lines += [markdown_table(table), ""]
    for budget, cell in s.groupby("budget", sort=False):
        eps = cell[[f"epsilon_{k}" for k in ACCOUNTANTS]].to_numpy(dtype=float)
        if np.isinf(eps[:, 0]).all():
            lines.append(f"- **{budget}**: no noise, so no privacy guarantee (epsilon = inf): a non-private reference "
                         "for what the methods can learn in this setting.")
        elif np.allclose(eps, eps[0], rtol=1e-9, equal_nan=True):
            lines.append(f"- **{budget}**: every method spent the same privacy ({acct} epsilon {_fmt(eps[0][0])}): they "
                         "ran the same mechanism (same noise multiplier, sampling and rounds). Server optimizers, "
                         "DiSK's filter and DP-MicroAdam's moments only post-process the released noisy average, and "
                         "client-side methods change what each client sends before the clip, not the mechanism.")
        else:
            lines.append(f"- **{budget}**: the methods' epsilons differ (they ran different noise multipliers or "
                         "numbers of rounds); compare them at their own epsilon in the table above.")
    return lines


def _canary_lines(results: StudyResults) -> list[str]:
    """Each run's canary estimates beside its budget accountant's epsilon, when any run has canaries."""
    runs = results.runs[results.runs["finished"]]
    if not len(runs) or runs["canary_andrew_final"].isna().all():
        return []
    acct = budget_accountant(results)
    table = pd.DataFrame({
        "run": runs["run_id"], f"epsilon ({acct})": runs[f"epsilon_{acct}"],
        **{f"{kind} ({words})": runs[f"canary_{key}_{score}"] for score, words in SCORES.items()
           for key, kind in (("andrew", "Andrew et al."), ("steinke", "Steinke et al. >="))}})
    return ["Empirical epsilon of the runs with canary clients (`privacy.canaries`, docs/audit.md): Andrew et al.'s "
            "estimate (arXiv:2302.03098) and Steinke et al.'s lower bound (arXiv:2305.08846) of an adversary who sees "
            "the final model, and of one who sees every round, at each run's delta:", "", markdown_table(table), ""]


def _selection_lines(results: StudyResults) -> list[str]:
    metric, mode, at = results.selection
    grids = {m: len(spec.grid) > 0 for m, spec in results.study.methods.items()}
    rule = (f"Each method's grid point is selected per budget by the **{'largest' if mode == 'max' else 'smallest'} "
            f"mean over seeds of `{metric}` at its {'final evaluation' if at == 'final' else 'best round'}**.")
    if not any(grids.values()):
        return ["No method has a hyperparameter grid: each method ran one setting."]
    if results.study.selection.split == "heldout":
        n = results.study.selection.heldout_clients
        caveat = (f"`{metric}` is each run's final model evaluated on {'all' if n is None else f'the first {n}'} "
                  "held-out users (the data's `heldout` split: users who neither train nor supply the test examples), "
                  "so the test metric of the selected point is not biased by the selection.")
    elif metric.startswith("test_"):
        caveat = ("This selects on the **test split** (the setting has no separate validation split), as the papers' "
                  "own protocols do (e.g. DiSK tunes its baseline on the test set): the selected numbers are "
                  "optimistically biased, more so for methods with larger grids. The whole grid is reported below.")
    elif metric == "train_loss":
        caveat = ("This selects on the clients' reported training loss (not privatized, not a held-out split), so "
                  "the test metric of the selected point is not biased by the selection.")
    else:
        caveat = "The whole grid is reported below."
    return [f"{rule} {caveat}"]


def _grid_table(results: StudyResults) -> pd.DataFrame:
    g, m = results.grid, results.metric
    return pd.DataFrame({
        "method": g["method"], "budget": g["budget"], "setting": g["hparams"], "seeds": g["n_seeds"],
        f"final {m}": [_pm(a, b) for a, b in zip(g[f"final_{m}_mean"], g[f"final_{m}_std"])],
        f"best {m}": [_pm(a, b) for a, b in zip(g[f"best_{m}_mean"], g[f"best_{m}_std"])],
        **_extra_columns(results, g),
        "selection score": g["score_mean"], "selected": ["yes" if x else "" for x in g["selected"]]})


def _extra_columns(results: StudyResults, table: pd.DataFrame) -> dict[str, list[str]]:
    """The study's extra ``columns`` (mean ± std over seeds), titled as in the docs tables."""
    return {column_title(c.name): [_pm(a, b) for a, b in zip(table[f"{c.name}_mean"], table[f"{c.name}_std"])]
            for c in results.study.columns}


def _summary_table(results: StudyResults) -> pd.DataFrame:
    s, m = results.summary, results.metric
    return pd.DataFrame({
        "method": s["method"], "budget": s["budget"], "selected setting": s["hparams"],
        "grid": s["grid_points"], "seeds": s["n_seeds"],
        f"final {m}": [_pm(a, b) for a, b in zip(s[f"final_{m}_mean"], s[f"final_{m}_std"])],
        f"best {m}": [_pm(a, b) for a, b in zip(s[f"best_{m}_mean"], s[f"best_{m}_std"])],
        **_extra_columns(results, s),
        f"selection ({results.selection[0]})": [_pm(a, b) for a, b in zip(s["selection_score_mean"],
                                                                         s["selection_score_std"])],
        f"epsilon ({budget_accountant(results)})": s[f"epsilon_{budget_accountant(results)}"],
        "wall s/run": s["wall_seconds_mean"]})


def _config_lines(results: StudyResults) -> list[str]:
    ids = _selected_run_ids(results)
    resolved = {key: flat(results_config(_resolved(results, rid))) for key, rid in ids.items()}
    given = {r["run_id"]: flat(results_config(r.get("config_set", r["config"]))) for r in results.manifest["runs"]}
    first = next(iter(resolved.values()))
    shared = {k: v for k, v in first.items()
              if k not in VARYING and all(f.get(k, "<unset>") == v for f in resolved.values())}
    lines = ["Shared by every selected run (resolved; `seed` and `output_dir` vary per run):", "", "```yaml",
             yaml.safe_dump(nested(shared), sort_keys=True).rstrip(), "```", "",
             "What each method sets on top, at each budget (its selected run, first seed; the noise multiplier as "
             "calibrated; a field not listed has RunConfig's default, see `configs/quickstart.yaml`):", ""]
    for (method, budget), rid in ids.items():
        own = {k: v for k, v in given[rid].items() if k not in shared and k not in VARYING}
        if "privacy.noise_multiplier" in own:
            own["privacy.noise_multiplier"] = resolved[(method, budget)].get("privacy.noise_multiplier")
        lines.append(f"- **{method}** at {budget} (`runs/{rid}`): "
                     + (", ".join(f"`{k}={v!r}`" for k, v in sorted(own.items())) or "nothing"))
    return lines


def render(results: StudyResults, figures: dict[str, list[Path]]) -> str:
    """The report's Markdown text."""
    st = results.study
    out = [f"# {st.name}", ""]
    if st.description:
        out += [st.description.strip(), ""]
    out += [f"Regenerate the tables, figures and this report from the stored runs: `fedprivacy report "
            f"{st.output_dir}`. Continue or extend the sweep: rerun `fedprivacy compare` with the same study "
            "(finished runs are skipped, interrupted ones resume from their checkpoints).", "",
            "## Setting", "", *_setting_lines(results), "", "## Results", ""]
    if not len(results.summary):
        out += ["No run has finished yet.", ""]
        return "\n".join(out)
    base = results.summary["majority_baseline"].mean()
    out += [markdown_table(_summary_table(results)), ""]
    if results.baseline_applies and np.isfinite(base):
        out += [f"Majority baseline (`{results.metric}` of always predicting the most frequent training label, "
                f"the 5 most frequent tags, or the most frequent word, by task): {_fmt(base)}.", ""]
    out += ["Mean ± sample std over seeds; final = last evaluation, best = best evaluation over rounds. Tables: "
            "`results/summary.csv` (this table), `results/grid.csv`, `results/runs.csv` (one row per run), "
            "`results/rounds.csv` (one row per run and round; `.parquet` beside each), `results/epsilon.csv` (epsilon "
            "per round under every accountant, from the selected runs' ledgers).", "",
            "## Selection", "", *_selection_lines(results), "", "## Privacy", "", *_privacy_lines(results), "",
            *_canary_lines(results),
            "## Figures", ""]
    for name, paths in figures.items():
        png = next(p for p in paths if p.suffix == ".png")
        out += [f"![{name}](figures/{png.name}) ", f"({name}: [SVG](figures/{png.stem}.svg))", ""]
    out += ["## Whole grid", "", markdown_table(_grid_table(results)), "", "## Resolved configurations", "",
            *_config_lines(results), ""]
    if results.failed or results.incomplete:
        out += ["## Runs without results", ""]
        out += [f"- `{rid}`: failed (see `runs/{rid}/error.txt`)" for rid in results.failed]
        out += [f"- `{rid}`: not finished" for rid in results.incomplete if rid not in results.failed]
        out.append("")
    return "\n".join(out)


def write_report(output_dir: str | Path) -> Path:
    """Tables (``results/``), figures (``figures/``) and ``report.md`` of the study in ``output_dir``."""
    output_dir = Path(output_dir)
    results = load_results(output_dir)
    write_tables(results, output_dir / "results")
    figures = {}
    if len(results.summary):
        curves = selected_epsilon_curves(results)
        curves.to_csv(output_dir / "results" / "epsilon.csv", index=False)
        figures = write_figures(results, output_dir / "figures", curves)
    path = output_dir / REPORT
    path.write_text(render(results, figures))
    return path
