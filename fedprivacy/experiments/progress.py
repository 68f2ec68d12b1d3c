"""The sweep's progress display: runs done / total, each active run's round, ETA (rich).

Progress is counted in rounds (a finished or skipped run counts all its rounds), so the ETA follows
the rate at which rounds complete, whatever the mix of run lengths. On a terminal it is a live rich
display; otherwise (logs, CI) one line per finished run.
"""

from __future__ import annotations

import math
import sys
from collections.abc import Callable
from typing import Any

from rich.console import Console
from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, TimeRemainingColumn


class SweepProgress:
    """Tracks a sweep: ``started(run)``, ``poll(rounds_of)`` and ``finished(run, ...)``; a context manager."""

    def __init__(self, rounds: dict[str, int], finished: list[str], enabled: bool | None = None,
                 console: Console | None = None) -> None:
        self.console = console or Console(stderr=True)
        self.enabled = self.console.is_terminal if enabled is None else enabled
        self.rounds = rounds
        self.closed = set(finished)
        self.total_runs = len(rounds)
        self.active: dict[str, Any] = {}
        self.progress = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                 TextColumn("rounds"), TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(),
                                 console=self.console, disable=not self.enabled, speed_estimate_period=300)
        done_rounds = sum(rounds[r] for r in finished)
        self.overall = self.progress.add_task(self._runs_text(), total=sum(rounds.values()), completed=done_rounds)
        self.done_rounds = {r: rounds[r] for r in finished}

    def _runs_text(self) -> str:
        return f"runs {len(self.closed)}/{self.total_runs} done"

    def __enter__(self) -> SweepProgress:
        self.progress.start()
        return self

    def __exit__(self, *exc) -> None:
        self.progress.stop()

    def _set_done(self, run_id: str, rounds: int) -> None:
        self.done_rounds[run_id] = rounds
        self.progress.update(self.overall, completed=sum(self.done_rounds.values()), description=self._runs_text())

    def started(self, run_id: str, rounds_done: int) -> None:
        if run_id in self.closed or run_id in self.active:
            return
        self.active[run_id] = self.progress.add_task(f"  {run_id}", total=self.rounds[run_id], completed=rounds_done)
        self._set_done(run_id, rounds_done)

    def poll(self, rounds_of: Callable[[str], int]) -> None:
        for run_id, task in self.active.items():
            n = min(rounds_of(run_id), self.rounds[run_id])
            self.progress.update(task, completed=n)
            self._set_done(run_id, n)

    def finished(self, run_id: str, status: str, summary: dict[str, Any] | None, error: str | None) -> None:
        task = self.active.pop(run_id, None)
        if task is not None:
            self.progress.remove_task(task)
        self.closed.add(run_id)
        self._set_done(run_id, self.rounds[run_id])
        if status == "failed":
            line = f"FAILED {run_id}: {error} (see its error.txt)"
        elif status == "skipped":
            line = f"{run_id}: already finished"
        else:
            metric = {k: v for k, v in (summary or {}).items() if k.startswith("test_") and not k.endswith("loss")}
            shown = ", ".join(f"{k} {v:.4f}" for k, v in metric.items() if isinstance(v, float) and math.isfinite(v))
            line = f"{run_id}: {summary.get('rounds_completed')} rounds" + (f", {shown}" if shown else "")
        text = f"[{len(self.closed)}/{self.total_runs}] {line}"
        if self.enabled:
            self.progress.console.print(text, highlight=False, markup=False)
        else:
            print(text, file=sys.stderr, flush=True)
