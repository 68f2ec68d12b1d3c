"""Experiments users run: method x budget x seed x hyperparameter sweeps, tables, figures, report.

``fedprivacy compare STUDY.yaml`` = :func:`compare`; ``fedprivacy report DIR`` = :func:`write_report`.

- :mod:`~fedprivacy.experiments.study`: the study schema and its expansion into runs.
- :mod:`~fedprivacy.experiments.sweep`: runs them in parallel worker processes, resumably.
- :mod:`~fedprivacy.experiments.results`, :mod:`~fedprivacy.experiments.figures`,
  :mod:`~fedprivacy.experiments.report`: tables, figures and the Markdown report from stored runs.
- :mod:`~fedprivacy.experiments.heldout`: final models evaluated on held-out users (selection).
- :mod:`~fedprivacy.experiments.docs`: stored study summaries and the docs tables generated from them.
"""

from __future__ import annotations

from pathlib import Path

from fedprivacy.experiments.report import write_report
from fedprivacy.experiments.study import StudyConfig, expand, load_study
from fedprivacy.experiments.sweep import SweepResult, run_sweep


def compare(study: StudyConfig, jobs: int | None = None, *, show_progress: bool | None = None,
            report: bool = True) -> tuple[SweepResult, Path | None]:
    """Run (or continue) the study's sweep, then write its tables, figures and report."""
    result = run_sweep(study, jobs, show_progress=show_progress)
    return result, (write_report(study.output_dir) if report else None)


__all__ = ["StudyConfig", "SweepResult", "compare", "expand", "load_study", "run_sweep",
           "write_report"]
