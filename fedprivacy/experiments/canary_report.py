"""The canary estimates of a run (``summary.json``'s ``empirical_epsilon``, :mod:`fedprivacy.fl.canaries`) where
users read them: one line at the end of ``fedprivacy run`` and for ``fedprivacy report RUN_DIR``
(:func:`estimates_line`), a column per estimate in a study's runs table (:func:`estimate_columns`), and a docs
table generated from a run's stored summary (:func:`export_run_summary`, :func:`render_canary_table`; the
``<!-- table:NAME:canaries -->`` blocks of :mod:`fedprivacy.experiments.docs`).

Each run has up to four numbers: Andrew et al.'s estimate (arXiv:2302.03098, Alg. 1) and Steinke et al.'s lower
bound (arXiv:2305.08846, Thm. 3.1) of two scores, the final model's cosine (``final``) and the largest cosine of a
round's model change (``every_round``, the adversary the accountant's epsilon is stated for).
"""

from __future__ import annotations

import json
import math
from collections.abc import Mapping
from pathlib import Path
from typing import Any

RUN_SUMMARY_VERSION = 1
SCORES = {"final": "final model", "every_round": "every round"}
"""The two scores (key -> words): the final model's change, and every round's."""


class RunSummaryError(ValueError):
    """A run folder or stored run summary lacks what a canary table needs (naming the file and the field)."""


def _scored(e: Mapping[str, Any]) -> dict[str, Mapping[str, Any]]:
    """score key -> its ``{"andrew": ..., "steinke": ...}`` (the final model's are at the top level)."""
    out = {"final": e}
    if e.get("every_round") is not None:
        out["every_round"] = e["every_round"]
    return out


def _eps(v: float | None) -> str:
    return "-" if v is None or (isinstance(v, float) and math.isnan(v)) else f"{v:.2f}"


def estimates_line(e: Mapping[str, Any]) -> str:
    """One line: both estimates of each score beside the accountant's epsilon, e.g. ``empirical epsilon (canaries):
    Andrew et al. 1.29 [0.08, 3.21] final model, 2.10 [0.95, 3.40] every round; Steinke et al. >= 0.00 final model,
    >= 0.00 every round at 95%; accountant 3.59 (pld)``."""
    if "error" in e:
        return (f"empirical epsilon (canaries): not estimated ({e['error']}); accountant "
                f"{_eps(e.get('epsilon_claimed'))} ({e['accountant']})")
    scored = _scored(e)
    andrew = ", ".join(f"{_eps(s['andrew']['epsilon'])} [{_eps(s['andrew']['interval'][0])}, "
                       f"{_eps(s['andrew']['interval'][1])}] {SCORES[k]}" for k, s in scored.items())
    steinke = ", ".join(f">= {_eps(s['steinke']['epsilon_lower_bound'])} {SCORES[k]}" for k, s in scored.items())
    confidence = e["steinke"]["confidence"]
    return (f"empirical epsilon (canaries): Andrew et al. {andrew}; Steinke et al. {steinke} at "
            f"{confidence:.0%}; accountant {_eps(e.get('epsilon_claimed'))} ({e['accountant']})")


def estimate_columns(summary: Mapping[str, Any] | None) -> dict[str, float]:
    """A run's estimates as flat columns (NaN without canaries): ``canary_andrew_<score>``,
    ``canary_steinke_<score>`` for each score of :data:`SCORES`."""
    e = (summary or {}).get("empirical_epsilon")
    scored = _scored(e) if e and "error" not in e else {}
    return {f"canary_{kind}_{k}": (float(scored[k][kind][field]) if k in scored else math.nan)
            for k in SCORES for kind, field in (("andrew", "epsilon"), ("steinke", "epsilon_lower_bound"))}


def read_run_summary(run_dir: str | Path) -> dict[str, Any]:
    """The run's ``summary.json`` with its ``empirical_epsilon``.

    Raises:
        RunSummaryError: the file is missing or unreadable, or the run had no ``privacy.canaries``.
    """
    path = Path(run_dir) / "summary.json"
    try:
        summary = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunSummaryError(f"{path}: cannot read the run's summary ({err})") from None
    if not isinstance(summary, dict) or not summary.get("empirical_epsilon"):
        raise RunSummaryError(f"{path}: no empirical_epsilon (the run had no privacy.canaries)")
    return summary


def export_run_summary(run_dir: str | Path, path: str | Path) -> Path:
    """Store the run's canary estimates and setting as JSON at ``path`` (a docs table's source); returns it."""
    summary = read_run_summary(run_dir)
    payload = {"version": RUN_SUMMARY_VERSION, "rounds_completed": summary["rounds_completed"],
               "population": summary["population"],
               "noise_multiplier": summary["noise_multiplier"], "empirical_epsilon": summary["empirical_epsilon"]}
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(payload, indent=1, sort_keys=True) + "\n")
    return path


def load_run_summary(path: str | Path) -> dict[str, Any]:
    """Read a summary written by :func:`export_run_summary`.

    Raises:
        RunSummaryError: not such a summary (naming the file and the field).
    """
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as err:
        raise RunSummaryError(f"{path}: cannot read the stored run summary ({err})") from None
    if not isinstance(data, dict) or data.get("version") != RUN_SUMMARY_VERSION:
        raise RunSummaryError(f"{path}: version {data.get('version') if isinstance(data, dict) else None!r}, "
                              f"expected {RUN_SUMMARY_VERSION}")
    for field in ("rounds_completed", "population", "noise_multiplier",
                  "empirical_epsilon"):
        if field not in data:
            raise RunSummaryError(f"{path}: no field {field!r}")
    return data


def render_canary_table(name: str, data: Mapping[str, Any]) -> str:
    """The run's estimates of each score beside the accountant's epsilon, and its setting."""
    e = data["empirical_epsilon"]
    rows = [f"| {SCORES[k]} | {_eps(s['andrew']['epsilon'])} ({_eps(s['andrew']['interval'][0])} - "
            f"{_eps(s['andrew']['interval'][1])}) | {_eps(s['steinke']['epsilon_lower_bound'])} "
            f"({s['steinke']['correct']} / {s['steinke']['guesses']}) | {_eps(e['epsilon_claimed'])} |"
            for k, s in _scored(e).items()]
    head = ["| adversary sees | Andrew et al. epsilon (95% interval) | Steinke et al. lower bound (correct / guesses) "
            f"| accountant ({e['accountant']}) |", "|---|---|---|---|"]
    foot = (f"{data['rounds_completed']} rounds, population {data['population']} "
            f"({e['canaries']} canaries, {e['included']} included, {e['unused']} unused directions), noise multiplier "
            f"{data['noise_multiplier']:.4g}, delta {e['delta']:g}. Generated from `docs/results/{name}.json` by "
            "`fedprivacy report --docs`; do not edit.")
    return "\n".join([*head, *rows]) + "\n\n" + foot + "\n"
