"""The machine line every benchmark prints first, so a number in BENCHMARKS.md names where it was measured."""

from __future__ import annotations

import datetime
import os
import platform

import torch


def cpu_name() -> str:
    """The CPU's model name (``/proc/cpuinfo``), else what ``platform`` knows."""
    try:
        with open("/proc/cpuinfo") as info:
            return next((line.split(":", 1)[1].strip() for line in info if line.startswith("model name")),
                        platform.processor())
    except OSError:
        return platform.processor()


def machine_line(versions: str = "") -> str:
    """``machine: CPU, N CPUs, torch V (T threads), <versions>Python V; date UTC; load average L``; ``versions``
    lists further libraries, each followed by ``", "``."""
    now = datetime.datetime.now(datetime.timezone.utc)
    return (f"machine: {cpu_name()}, {os.cpu_count()} CPUs, torch {torch.__version__} ({torch.get_num_threads()} "
            f"threads), {versions}Python {platform.python_version()}; {now:%Y-%m-%d %H:%M} UTC; load average "
            f"{os.getloadavg()[0]:.2f}")
