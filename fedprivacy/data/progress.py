"""Progress of long data work (generating synthetic data, building the preprocessing cache, decompressing a
download): a rich bar on stderr when it is a terminal, nothing otherwise (logs, CI, a sweep's workers), as
:class:`fedprivacy.experiments.progress.SweepProgress` decides (``Console.is_terminal``)."""

from __future__ import annotations

from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")


def stderr_console() -> Console:
    """Where data progress goes by default: stderr."""
    from rich.console import Console

    return Console(stderr=True)


@contextmanager
def progress_bar(description: str, total: int, unit: str, console: Console | None = None
                 ) -> Iterator[Callable[[int], None]]:
    """A bar of ``total`` ``unit`` (``bytes``: shown as sizes and a rate) on ``console`` (default:
    :func:`stderr_console`) when it is a terminal, silent otherwise; yields ``advance(n)``. rich is imported
    here, when data work starts."""
    from rich.progress import (BarColumn, DownloadColumn, MofNCompleteColumn, Progress, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn, TransferSpeedColumn)

    console = console or stderr_console()
    counted = [DownloadColumn(), TransferSpeedColumn()] if unit == "bytes" else [MofNCompleteColumn(), TextColumn(unit)]
    progress = Progress(TextColumn(description), BarColumn(), *counted, TimeElapsedColumn(), TextColumn("ETA"),
                        TimeRemainingColumn(), console=console, disable=not console.is_terminal)
    task = progress.add_task(description, total=total)
    with progress:
        yield lambda n: progress.advance(task, n)


def with_progress(items: Iterable[T], total: int, description: str, unit: str,
                  console: Console | None = None) -> Iterator[T]:
    """``items`` one by one, advancing a :func:`progress_bar` to ``total`` ``unit`` (e.g. users); the bar stops
    when the items end or the consumer stops."""
    with progress_bar(description, total, unit, console) as advance:
        for item in items:
            yield item
            advance(1)
