"""Progress displays (rich): a sweep's runs done / total, each active run's round and the ETA
(:class:`SweepProgress`); one run's round N of T, elapsed time, ETA, epsilon and last test accuracy
(:class:`RunProgress`).

Progress is counted in rounds (a finished or skipped run counts all its rounds), so the ETA follows
the rate at which rounds complete, whatever the mix of run lengths. On a terminal it is a live rich
display; otherwise (logs, CI) one line per finished run.
"""

from __future__ import annotations

import logging
import math
import sys
import time
from collections.abc import Callable, Mapping
from typing import Any

from rich.console import Console
from rich.logging import RichHandler
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


class RunProgress:
    """One run's progress (``fedprivacy run``): round N of T, elapsed time, ETA, the current epsilon and
    the last test accuracy; a context manager whose :meth:`round_done` is the run's ``on_round``.

    ``mode``: ``live`` (a rich display, which the log lines print above), ``lines`` (one plain line
    on stderr for the first and the last round and at most every ``every_s`` seconds between; for
    logs and CI), ``off``; ``None``: ``live`` on a terminal, else ``lines``. The ETA is the mean
    wall time per round so far in this process (from :meth:`__enter__`, so start-up counts in the
    first round) times the rounds left: :math:`\\hat t = (t - t_0) (T - N) / (N - N_0)`, where
    :math:`N_0` rounds were done before (a resumed run).
    """

    def __init__(self, rounds: int, accountant: str, mode: str | None = None, console: Console | None = None,
                 every_s: float = 10.0, clock: Callable[[], float] = time.monotonic) -> None:
        self.console = console or Console(stderr=True)
        self.mode = mode or ("live" if self.console.is_terminal else "lines")
        self.rounds, self.accountant, self.every_s, self.clock = rounds, accountant, every_s, clock
        self.accuracy = math.nan
        self._started = self._printed = 0.0
        self._first: int | None = None  # rounds done before this process's first round
        self._handlers: list[tuple[logging.Handler, logging.Handler]] = []
        self.progress = Progress(TextColumn("round"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TextColumn("ETA"), TimeRemainingColumn(), TextColumn("{task.fields[status]}"),
                                 console=self.console, disable=self.mode != "live")
        self.task = self.progress.add_task("run", total=rounds, status="")

    def __enter__(self) -> RunProgress:
        self._started = self.clock()
        if self.mode == "live":  # log lines through the display's console, above it (a plain handler would tear it)
            root = logging.getLogger()
            for old in [h for h in root.handlers if type(h) is logging.StreamHandler]:
                new = RichHandler(console=self.console, show_path=False, show_level=False, log_time_format="%H:%M:%S")
                new.setLevel(old.level)
                root.removeHandler(old)
                root.addHandler(new)
                self._handlers.append((old, new))
            self.progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.progress.stop()
        root = logging.getLogger()
        for old, new in self._handlers:
            root.removeHandler(new)
            root.addHandler(old)
        self._handlers = []

    def round_done(self, round_: int, row: Mapping[str, float]) -> None:
        """Round ``round_`` is recorded with metrics ``row`` (``epsilon_<accountant>``, and ``test_accuracy``
        in the rounds that evaluate)."""
        now = self.clock()
        if self._first is None:
            self._first = round_ - 1
        accuracy = row.get("test_accuracy", math.nan)
        if accuracy == accuracy:
            self.accuracy = accuracy
        epsilon = row.get(f"epsilon_{self.accountant}", math.nan)
        status = f"eps({self.accountant}) {epsilon:.3f}, test accuracy " + (
            f"{self.accuracy:.4f}" if self.accuracy == self.accuracy else "-")
        if self.mode == "live":
            self.progress.update(self.task, completed=round_, status=status)
        elif self.mode == "lines" and (round_ in (self._first + 1, self.rounds) or now - self._printed >= self.every_s):
            self._printed = now
            elapsed = now - self._started
            eta = elapsed / (round_ - self._first) * max(self.rounds - round_, 0)
            print(f"round {round_}/{self.rounds} | elapsed {_clock_time(elapsed)} | ETA {_clock_time(eta)} | {status}",
                  file=self.console.file, flush=True)

    def run_done(self, summary: Mapping[str, Any]) -> None:
        """The run ended with ``summary``: print its canary estimates beside the accountant's epsilon (runs with
        ``privacy.canaries``; :func:`~fedprivacy.experiments.canary_report.estimates_line`), unless ``off``."""
        if self.mode == "off" or not summary.get("empirical_epsilon"):
            return
        from fedprivacy.experiments.canary_report import estimates_line

        line = estimates_line(summary["empirical_epsilon"])
        if self.mode == "live":
            self.progress.console.print(line, highlight=False, markup=False)
        else:
            print(line, file=self.console.file, flush=True)


def _clock_time(seconds: float) -> str:
    """``H:MM:SS`` (rounded to the second)."""
    s = int(round(seconds))
    return f"{s // 3600}:{s // 60 % 60:02d}:{s % 60:02d}"
