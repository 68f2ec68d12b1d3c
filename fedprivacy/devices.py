"""Devices: whether this machine has a run's ``device``, and which GPU each ``compare`` worker gets.

The config accepts ``cpu``, ``cuda``, ``cuda:N`` and ``mps`` anywhere (:class:`~fedprivacy.config.RunConfig`);
:func:`check_run_device` checks at run start that the installed torch and this machine provide it,
and raises :class:`DeviceUnavailableError` (a :class:`~fedprivacy.config.ConfigError`: the CLI
prints its one line and exits 2) otherwise.

``fedprivacy compare`` gives each worker process one GPU by setting ``CUDA_VISIBLE_DEVICES`` in it
(:func:`worker_gpus`): worker ``i`` sees only the ``i mod n``-th visible GPU, as ``cuda:0``. The
runs' configs stay as written (``device: cuda``), so a study resumes on a machine with a different
number of GPUs.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

from fedprivacy.config import ConfigError, RunConfig

log = logging.getLogger(__name__)

CUDA_INSTALL_HINT = "pip install torch --index-url https://download.pytorch.org/whl/cu124"


class DeviceUnavailableError(ConfigError):
    """The configured ``device`` does not exist on this machine or in this build of torch."""


def require_device(device: str) -> None:
    """Raise :class:`DeviceUnavailableError` (one line, naming ``device``) unless torch can use ``device`` here."""
    if device.startswith("cuda"):
        if not torch.cuda.is_available():
            if torch.version.cuda is None:
                raise DeviceUnavailableError(
                    f"device={device!r}, but the installed torch {torch.__version__} is a CPU-only build; install "
                    f"a CUDA build (e.g. {CUDA_INSTALL_HINT}) or set device: cpu")
            raise DeviceUnavailableError(
                f"device={device!r}, but torch {torch.__version__} (CUDA {torch.version.cuda}) finds no GPU: check "
                "the NVIDIA driver (nvidia-smi) and CUDA_VISIBLE_DEVICES, or set device: cpu")
        index, count = torch.device(device).index, torch.cuda.device_count()
        if index is not None and index >= count:
            raise DeviceUnavailableError(f"device={device!r}, but torch sees {count} GPU(s) here "
                                         f"(cuda:0 to cuda:{count - 1})")
    elif device == "mps" and not torch.backends.mps.is_available():
        raise DeviceUnavailableError("device='mps', but MPS is not available here (it needs Apple silicon, "
                                     "macOS 12.3+ and a torch built with MPS); set device: cpu")


def check_run_device(cfg: RunConfig) -> None:
    """At run start: :func:`require_device`, and a warning when Ray reserves GPUs that a CPU run never uses."""
    require_device(cfg.device)
    if cfg.engine == "ray" and cfg.ray.num_gpus > 0 and cfg.device == "cpu":
        log.warning("ray.num_gpus=%g reserves GPU shares for clients that train on device 'cpu': set device: cuda "
                    "to use them, or ray.num_gpus: 0", cfg.ray.num_gpus)


def visible_gpus() -> list[str]:
    """The GPUs this process may use, as ``CUDA_VISIBLE_DEVICES`` entries (indices or UUIDs)."""
    count = torch.cuda.device_count()
    listed = os.environ.get("CUDA_VISIBLE_DEVICES")
    return listed.split(",")[:count] if listed is not None else [str(i) for i in range(count)]


def worker_gpus(devices: Iterable[str], workers: int | None) -> list[str] | None:
    """``CUDA_VISIBLE_DEVICES`` of each compare worker, or None when no run uses CUDA.

    Worker ``i`` gets the ``i mod n``-th of the ``n`` visible GPUs; ``workers=None`` means one
    worker per GPU. Such a worker sees one GPU, so a run must say ``cuda`` (or ``cuda:0``): a
    higher index is refused here, once, rather than failing every run.

    Raises:
        DeviceUnavailableError: a run uses CUDA and there is none, or names a GPU index other than 0.
    """
    cuda = sorted({d for d in devices if d.startswith("cuda")})
    if not cuda:
        return None
    for device in cuda:
        require_device(device)
        if device not in ("cuda", "cuda:0"):
            raise DeviceUnavailableError(
                f"device={device!r}: fedprivacy compare gives each worker one GPU (as cuda:0, through "
                "CUDA_VISIBLE_DEVICES), so the study's runs must say device: cuda; to use only some GPUs, "
                "set CUDA_VISIBLE_DEVICES before compare")
    gpus = visible_gpus()
    return [gpus[i % len(gpus)] for i in range(workers or len(gpus))]

