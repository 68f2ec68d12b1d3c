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

from fedprivacy.experiments import study as _study
from fedprivacy.experiments.docs import tuned
from fedprivacy.experiments.report import write_report
from fedprivacy.experiments.study import StudyConfig, expand
from fedprivacy.experiments.sweep import SweepResult, run_sweep


def load_study(path: str | Path, overrides: list[str] | tuple[str, ...] = ()) -> StudyConfig:
    """Read a study YAML file, apply ``overrides``, and take its methods' grid points from the study it is
    ``tuned_on`` (:func:`~fedprivacy.experiments.docs.tuned`), if any."""
    return tuned(_study.load_study(path, overrides))


def compare(study: StudyConfig, jobs: int | None = None, *, show_progress: bool | None = None,
            report: bool = True) -> tuple[SweepResult, Path | None]:
    """Run (or continue) the study's sweep, then write its tables, figures and report."""
    result = run_sweep(study, jobs, show_progress=show_progress)
    return result, (write_report(study.output_dir) if report else None)


__all__ = ["StudyConfig", "SweepResult", "compare", "expand", "load_study", "run_sweep",
           "write_report"]
