"""Progress of long data work (generating synthetic data, building the preprocessing cache): a rich bar on
stderr when it is a terminal, nothing otherwise (logs, CI, a sweep's workers), as
:class:`fedprivacy.experiments.progress.SweepProgress` decides (``Console.is_terminal``)."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from rich.console import Console

T = TypeVar("T")


def stderr_console() -> Console:
    """Where data progress goes by default: stderr."""
    from rich.console import Console

    return Console(stderr=True)


def with_progress(items: Iterable[T], total: int, description: str, unit: str,
                  console: Console | None = None) -> Iterator[T]:
    """``items`` one by one, advancing a bar to ``total`` ``unit`` (e.g. users) on ``console`` (default:
    :func:`stderr_console`) when it is a terminal; silent otherwise. The bar stops when the items end or the
    consumer stops. rich is imported here, when data work starts."""
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn,
                               TimeRemainingColumn)

    console = console or stderr_console()
    progress = Progress(TextColumn(description), BarColumn(), MofNCompleteColumn(), TextColumn(unit),
                        TimeElapsedColumn(), TextColumn("ETA"), TimeRemainingColumn(), console=console,
                        disable=not console.is_terminal)
    task = progress.add_task(description, total=total)
    with progress:
        for item in items:
            yield item
            progress.advance(task)
