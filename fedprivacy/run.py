"""Run one configured federated training on the chosen engine."""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

import torch

from fedprivacy.config import RunConfig
from fedprivacy.devices import check_run_device
from fedprivacy.engines.cohorts import cohort_trainer
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.canaries import population_with_canaries
from fedprivacy.engines.processes import run_processes
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.server_app import build_server_app
from fedprivacy.callbacks import RoundCallback
from fedprivacy.outputs import require_checkpoint, run_lock
from fedprivacy.stackoverflow_tasks import ensure_data, load_task
from fedprivacy.stopping import stop_on_sigterm

log = logging.getLogger(__name__)


def prepare_data(cfg: RunConfig, resume: bool = False) -> None:
    """Refuse a ``device`` this machine lacks and a ``resume`` with nothing to resume, then generate missing data
    and build the preprocessing cache (each with its progress bar on a terminal): ``run`` starts so; a caller
    showing a live display of its own calls this before opening it, as two live displays on one terminal garble
    each other."""
    check_run_device(cfg)
    if resume:
        require_checkpoint(cfg.output_dir)
    ensure_data(cfg.data)
    load_task(cfg.data)  # cached: ``run`` gets the same task


def run(cfg: RunConfig, resume: bool = False, on_round: RoundCallback | None = None) -> dict[str, Any]:
    """Prepare the data, run the ServerApp and ClientApp on ``cfg.engine``, return the summary.
    ``on_round(round, metrics row)`` is called after each round the server records (e.g.
    :class:`~fedprivacy.experiments.progress.RunProgress`).

    The run holds ``cfg.output_dir``'s lock throughout: a second run into the folder is refused
    (:class:`~fedprivacy.locks.FolderBusyError` naming this one's pid, host and start time). A
    ``device`` this machine lacks is refused first (:class:`~fedprivacy.devices.DeviceUnavailableError`).

    SIGTERM stops the run after its current round with a checkpoint (:mod:`fedprivacy.stopping`: raises
    :class:`~fedprivacy.stopping.RunStopped`; resuming loses nothing).
    """
    if cfg.num_threads is not None:
        torch.set_num_threads(cfg.num_threads)
    started = time.time()
    prepare_data(cfg, resume)
    with run_lock(cfg.output_dir), stop_on_sigterm():
        task = load_task(cfg.data)
        server_app, client_app = build_server_app(cfg, resume, on_round), build_client_app(cfg)
        if cfg.engine == "inprocess":  # the ClientApps run here: read each cohort's rows ahead
            run_inprocess(server_app, client_app, population_with_canaries(cfg, task.population), prefetch=getattr(task, "prefetch", None),
                          processes=run_processes(cfg), cohort=cohort_trainer(cfg))
        else:
            from fedprivacy.engines.ray import run_ray

            run_ray(server_app, client_app, population_with_canaries(cfg, task.population), cfg.ray)
    summary_path = Path(cfg.output_dir) / "summary.json"
    if not summary_path.exists() or summary_path.stat().st_mtime < started:
        raise RuntimeError(f"the {cfg.engine} engine finished without writing {summary_path}; see the log above")
    return json.loads(summary_path.read_text())
