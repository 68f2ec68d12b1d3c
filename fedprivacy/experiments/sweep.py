"""Run a study's runs in parallel worker processes, resumably.

Layout of a study's ``output_dir``::

    study.json          the study and every run's config (written before any run starts)
    runs/<run_id>/      one ``fedprivacy run`` folder per run, plus run.log (its log),
                        sweep_run.json (attempts and wall time) and error.txt (if it failed)
    results/, figures/, report.md      written by :func:`fedprivacy.experiments.report.write_report`

Resume: a run whose ``summary.json`` is complete is skipped; any other run is started with
``run(cfg, resume=True)`` when it has a ``checkpoint.pt``, which continues from it (model, optimizer,
sampler, noise generator and privacy ledger as they were), or fresh when there is none. Rerunning the
same study therefore continues an interrupted sweep. Stopping the sweep (Ctrl-C, or SIGTERM to it) sends
SIGTERM to each worker, whose run finishes its round, checkpoints and returns (:mod:`fedprivacy.stopping`), so
nothing is lost; a worker not done within :data:`STOP_GRACE_S` (or on a second Ctrl-C) is killed. A study whose runs' configs changed since
``study.json`` was written is refused (:class:`StudyChangedError`); new runs (an extra seed, method
or grid value) are added.

Workers are ``spawn``-ed processes (no state shared with the parent; torch uses one thread each). A
run that would use every core (``processes: null``, the default) gets its share of them instead
(:func:`cores_per_run`): ``jobs`` runs on ``usable_cores() // jobs`` cores each (at least one).
Tracking (a run's ``tracking`` section) changes no result: a study may switch it on or off between
sweeps; its MLflow experiment is created here, before the workers start.
When the runs use CUDA, each worker sees one GPU (``CUDA_VISIBLE_DEVICES``: worker ``i`` the
``i mod n``-th of ``n``, :func:`fedprivacy.devices.worker_gpus`) and there is one worker per GPU by default.
Data are generated and the preprocessing cache is filled in the parent first, so workers never race
to build them. A worker dies with its parent (at once on Linux, ``PR_SET_PDEATHSIG``; elsewhere at the
next 0.5 s check), and holds a lock on its run folder while it runs, so a restarted sweep never writes
into a run an orphan still holds.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import threading
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait
from concurrent.futures.process import BrokenProcessPool
from multiprocessing import get_context
from pathlib import Path
from typing import Any

from fedprivacy.checkpoints import load_checkpoint
from fedprivacy.config import RunConfig, config_differences, config_from_json
from fedprivacy.devices import worker_gpus
from fedprivacy.engines.processes import die_with_parent, run_processes, usable_cores
from fedprivacy.experiments.progress import SweepProgress
from fedprivacy.experiments.study import RunSpec, StudyConfig, expand
from fedprivacy.locks import FolderBusyError, locked
from fedprivacy.outputs import CHECKPOINT, run_lock
from fedprivacy.stopping import RunStopped
from fedprivacy.tracking import experiment_name, tracking_uri

log = logging.getLogger(__name__)

MANIFEST = "study.json"
RUN_RECORD = "sweep_run.json"
ERROR_FILE = "error.txt"
MANIFEST_VERSION = 1
STOP_GRACE_S = 120.0  # how long a stopping sweep waits for its runs to finish their round and checkpoint


class StudyChangedError(ValueError):
    """The study's output folder holds runs of a different configuration."""


class SweepBusyError(FolderBusyError):
    """Another ``fedprivacy compare`` is running on the same output folder."""


# -- run folders ------------------------------------------------------------------------------
def run_dir(study: StudyConfig, run_id: str) -> Path:
    return Path(study.output_dir) / "runs" / run_id


def read_summary(folder: Path) -> dict[str, Any] | None:
    """A run's ``summary.json`` if it is complete (``None`` if missing or cut short by a kill)."""
    try:
        summary = json.loads((folder / "summary.json").read_text())
    except (OSError, ValueError):
        return None
    return summary if isinstance(summary, dict) and "rounds_completed" in summary else None


def _read_record(folder: Path) -> dict[str, Any]:
    try:
        return json.loads((folder / RUN_RECORD).read_text())
    except (OSError, ValueError):
        return {"attempts": []}


def _write_record(folder: Path, record: dict[str, Any]) -> None:
    tmp = folder / (RUN_RECORD + ".tmp")
    tmp.write_text(json.dumps(record, indent=2))
    os.replace(tmp, folder / RUN_RECORD)


def run_state(folder: Path) -> str:
    """``finished``, ``partial`` (a checkpoint to resume from) or ``new``.

    Finished means a complete ``summary.json`` and, for a run started by a sweep, that its last attempt
    returned: a worker stopped after the summary was written but before ``run`` returned (it still
    plots) is resumed, which at the last round only rewrites the final files.
    """
    record = _read_record(folder)
    returned = not record["attempts"] or record["attempts"][-1].get("wall_seconds") is not None
    if read_summary(folder) is not None and returned:
        return "finished"
    return "partial" if (folder / CHECKPOINT).exists() else "new"


def rounds_logged(folder: Path) -> int:
    """Rows of the run's ``metrics.csv`` (its completed rounds), 0 if none yet."""
    try:
        with open(folder / "metrics.csv", "rb") as f:
            return max(sum(1 for _ in f) - 1, 0)
    except OSError:
        return 0


def checkpoint_round(folder: Path) -> int:
    """The round the run's ``checkpoint.pt`` holds (0 without one): where a resume continues from."""
    if not (folder / CHECKPOINT).exists():
        return 0
    return int(load_checkpoint(folder / CHECKPOINT, mmap=True, map_location="cpu")["round"])


# -- manifest ---------------------------------------------------------------------------------
def manifest(study: StudyConfig, specs: list[RunSpec]) -> dict[str, Any]:
    return {"version": MANIFEST_VERSION, "study": study.model_dump(mode="json"),
            "runs": [{"run_id": s.run_id, "method": s.method, "budget": s.budget, "seed": s.seed,
                      "hparams": s.hparams, "config": json.loads(s.config.to_json()),
                      "config_set": json.loads(s.config.model_dump_json(exclude_unset=True))} for s in specs]}


def read_manifest(output_dir: Path) -> dict[str, Any]:
    path = Path(output_dir) / MANIFEST
    try:
        data = json.loads(path.read_text())
    except FileNotFoundError:
        raise FileNotFoundError(f"{path} not found: not the output folder of a `fedprivacy compare` study") from None
    except ValueError as err:
        raise ValueError(f"{path} is not valid JSON: {err}") from None
    if data.get("version") != MANIFEST_VERSION:
        raise ValueError(f"{path}: unsupported manifest version {data.get('version')!r}")
    return data


def results_config(config: dict[str, Any]) -> dict[str, Any]:
    """A run's config (``to_json()`` as a tree) without ``tracking``, which changes no result."""
    return {k: v for k, v in config.items() if k != "tracking"}


def check_compatible(old: dict[str, Any], new: dict[str, Any]) -> None:
    """Refuse a study whose runs (same id) now have a different config than when they were started
    (:func:`results_config`: tracking may change). A field the stored config lacks reads as null, so an optional
    section added to the config since (null by default: the feature off) changes nothing.

    Raises:
        StudyChangedError: names the first such run and the fields that changed.
    """
    before = {r["run_id"]: results_config(r["config"]) for r in old["runs"]}
    for run in new["runs"]:
        changed = (config_differences(before[run["run_id"]], results_config(run["config"]))
                   if run["run_id"] in before else {})
        if changed:
            diff = [f"{k}: {a!r} -> {b!r}" for k, (a, b) in changed.items()]
            raise StudyChangedError(
                f"{old['study']['output_dir']} holds run {run['run_id']} with a different configuration "
                f"({'; '.join(diff[:5])}); use another output_dir (--set output_dir=...) or restore the study")


# -- worker process ---------------------------------------------------------------------------
_events = None


def _watch_parent(parent: int) -> None:
    while True:
        if os.getppid() != parent:  # the sweep died (killed): stop, the restart resumes this run
            os._exit(1)
        time.sleep(0.5)


def _init_worker(events, parent: int, gpu: str | None) -> None:
    """Set up a worker; ``gpu``: the one GPU it sees, as ``cuda:0`` (set before anything initialises CUDA)."""
    global _events
    _events = events
    if gpu is not None:
        os.environ["CUDA_VISIBLE_DEVICES"] = gpu
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # Ctrl-C reaches the parent, which stops the workers
    die_with_parent(parent)  # at once on Linux: an orphan must not finish rounds for a dead sweep
    threading.Thread(target=_watch_parent, args=(parent,), daemon=True).start()  # also where prctl is missing


def _log_to(path: Path) -> None:
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
        h.close()
    handler = logging.FileHandler(path)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    root.addHandler(handler)
    root.setLevel(logging.INFO)


def execute(run_id: str, config_json: str) -> dict[str, Any]:
    """Run (or resume, or skip if finished) one run of a sweep (``config_json``: ``RunConfig.to_json()``);
    never raises."""
    from fedprivacy.run import run

    cfg: RunConfig = config_from_json(config_json)
    folder = Path(cfg.output_dir)
    with run_lock(folder, blocking=True):
        if run_state(folder) == "finished":
            return {"run_id": run_id, "status": "skipped"}
        if _events is not None:
            _events.put(("start", run_id))
        _log_to(folder / "run.log")
        (folder / ERROR_FILE).unlink(missing_ok=True)
        record = _read_record(folder)
        t0 = time.perf_counter()
        try:
            record["attempts"].append({"start_round": checkpoint_round(folder), "wall_seconds": None})
            _write_record(folder, record)
            summary = run(cfg, resume=(folder / CHECKPOINT).exists())
        except RunStopped:  # the sweep is stopping: checkpointed after a whole round, resumes with nothing lost
            return {"run_id": run_id, "status": "failed",
                    "error": "stopped on request (SIGTERM) after a whole round, checkpointed: rerun the sweep to resume it"}
        except BaseException as err:  # noqa: BLE001 - reported to the parent, which carries on
            (folder / ERROR_FILE).write_text(traceback.format_exc())
            logging.getLogger(__name__).exception("run %s failed", run_id)
            return {"run_id": run_id, "status": "failed", "error": f"{type(err).__name__}: {err}"}
        record["attempts"][-1]["wall_seconds"] = time.perf_counter() - t0
        _write_record(folder, record)
        return {"run_id": run_id, "status": "done", "summary": summary}


# -- the sweep --------------------------------------------------------------------------------
@dataclass
class SweepResult:
    """What a sweep did: runs skipped (already finished), run now, failed (id -> error)."""

    skipped: list[str] = field(default_factory=list)
    done: list[str] = field(default_factory=list)
    failed: dict[str, str] = field(default_factory=dict)


def prepare_data(specs: list[RunSpec]) -> None:
    """Generate missing synthetic data and fill the preprocessing cache once, before any worker starts."""
    from fedprivacy.stackoverflow_tasks import ensure_data, load_task

    seen: set[str] = set()
    for spec in specs:
        key = spec.config.data.model_dump_json()
        if key not in seen:
            seen.add(key)
            ensure_data(spec.config.data)
            load_task(spec.config.data)


def prepare_tracking(specs: list[RunSpec]) -> None:
    """Create the runs' MLflow experiments once, before the workers start: workers creating one at the same time
    in a file store could make two of the same name."""
    experiments = {(tracking_uri(s.config.output_dir, s.config.tracking.mlflow_uri),
                    experiment_name(s.config.output_dir, s.config.tracking)) for s in specs if s.config.tracking.mlflow}
    if experiments:
        from fedprivacy.tracking.mlflow_writer import client_for, experiment_id

        for uri, name in sorted(experiments):
            experiment_id(client_for(uri), name)


@contextmanager
def _single_threaded_children() -> Iterator[None]:
    """BLAS/OpenMP in spawned workers use one thread (torch's own count is set by each run)."""
    names = ("OMP_NUM_THREADS", "MKL_NUM_THREADS", "OPENBLAS_NUM_THREADS")
    saved = {n: os.environ.get(n) for n in names}
    for n in names:
        os.environ.setdefault(n, "1")
    try:
        yield
    finally:
        for n, v in saved.items():
            if v is None:
                os.environ.pop(n, None)
            else:
                os.environ[n] = v


def _terminate(signum, frame):  # SIGTERM: stop like Ctrl-C (workers stopped, folder resumable)
    raise KeyboardInterrupt


def _stop_workers(pools: list[ProcessPoolExecutor], grace_s: float = STOP_GRACE_S) -> None:
    """SIGTERM each worker: its run finishes the round in progress, writes a checkpoint and returns
    (:mod:`fedprivacy.stopping`: nothing is lost); a worker still alive after ``grace_s`` (or on a second
    Ctrl-C) is killed, and its run resumes from its last checkpoint with the releases after it spent."""
    processes = [p for pool in pools for p in (getattr(pool, "_processes", None) or {}).values()]  # no public API
    for process in processes:  # before 3.14
        if process.is_alive():
            process.terminate()
    for pool in pools:  # a worker whose run stopped exits instead of waiting for the next run
        pool.shutdown(wait=False, cancel_futures=True)
    deadline = time.monotonic() + grace_s
    try:
        for process in processes:
            process.join(max(0.0, deadline - time.monotonic()))
    finally:
        for process in processes:
            if process.is_alive():
                process.kill()


def run_sweep(study: StudyConfig, jobs: int | None = None, *, show_progress: bool | None = None) -> SweepResult:
    """Run every unfinished run of ``study`` (resuming partial ones) with ``jobs`` worker processes.

    ``jobs=None``: one worker per GPU when the runs use CUDA, else one per usable core.

    Raises:
        StudyChangedError: the output folder holds runs of a different configuration.
        SweepBusyError: another sweep is running on the folder.
        DeviceUnavailableError: the runs use CUDA and this machine has none (:func:`~fedprivacy.devices.worker_gpus`).
        KeyboardInterrupt: interrupted (Ctrl-C or SIGTERM); workers are stopped, the folder resumes.
    """
    specs = expand(study)
    out = Path(study.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    with locked(out / ".sweep.lock", blocking=False, error=SweepBusyError, what="`fedprivacy compare`"):
        new = manifest(study, specs)
        if (out / MANIFEST).exists():
            check_compatible(read_manifest(out), new)
        (out / MANIFEST).write_text(json.dumps(new, indent=1))
        result = SweepResult()
        todo = []
        for s in specs:
            if run_state(run_dir(study, s.run_id)) == "finished":
                result.skipped.append(s.run_id)
            else:
                todo.append(s)
        if todo:
            gpus = worker_gpus((s.config.device for s in todo), jobs)
            prepare_data(todo)
            prepare_tracking(todo)
            _run_parallel(study, specs, todo, len(gpus) if gpus else jobs or usable_cores(), result, show_progress,
                          gpus=gpus)
        return result


def cores_per_run(cfg: RunConfig, jobs: int) -> RunConfig:
    """``cfg`` with ``processes`` set to its share of the cores, ``max(1, usable_cores() // jobs)``,
    when it would use every core (``processes: null`` on the in-process CPU engine): ``jobs`` runs at
    once then never ask for more cores than there are. A run that names its ``processes`` keeps them."""
    if cfg.processes is not None or run_processes(cfg) == 1:
        return cfg
    return cfg.model_copy(update={"processes": max(1, usable_cores() // jobs)})


def _run_parallel(study: StudyConfig, specs: list[RunSpec], todo: list[RunSpec], jobs: int, result: SweepResult,
                  show_progress: bool | None, target: Callable[[str, str], dict[str, Any]] = execute,
                  gpus: list[str] | None = None) -> None:
    """Run ``todo`` on ``jobs`` one-worker pools, ``target(run_id, config_json)`` per run (:func:`execute`);
    pool ``i`` sees GPU ``gpus[i]`` alone (``gpus``: one entry per pool, or None for no GPU).

    Each pool has one worker, so a worker that dies (killed for memory, ``kill -9``) breaks only its
    own pool: only the run it was running fails, its pool is replaced, and the other runs go on.
    """
    ctx = get_context("spawn")
    events = ctx.Queue()
    rounds = {s.run_id: s.config.rounds for s in specs}
    progress = SweepProgress(rounds, finished=result.skipped, enabled=show_progress)
    previous = signal.signal(signal.SIGTERM, _terminate) if threading.current_thread() is threading.main_thread() else None

    gpu_of: dict[ProcessPoolExecutor, str | None] = {}

    def new_pool(gpu: str | None) -> ProcessPoolExecutor:
        with _single_threaded_children():
            pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker,
                                       initargs=(events, os.getpid(), gpu))
        gpu_of[pool] = gpu
        return pool

    idle = [new_pool(gpus[i] if gpus else None) for i in range(min(jobs, len(todo)))]
    queue, running = list(reversed(todo)), {}  # future -> (run id, its pool)
    try:
        with progress:
            while queue or running:
                while queue and idle:
                    spec, pool = queue.pop(), idle.pop()
                    running[pool.submit(target, spec.run_id, cores_per_run(spec.config, jobs).to_json())] = (
                        spec.run_id, pool)
                while not events.empty():
                    _, rid = events.get()
                    progress.started(rid, rounds_logged(run_dir(study, rid)))
                done, _ = wait(running, timeout=0.25, return_when=FIRST_COMPLETED)
                for future in done:
                    rid, pool = running.pop(future)
                    try:
                        outcome = future.result()
                    except BrokenProcessPool:  # its worker died (e.g. killed for memory): rerunning resumes
                        outcome = {"run_id": rid, "status": "failed",
                                   "error": "its worker process died (killed?); rerun the sweep to resume this run"}
                        pool.shutdown(wait=False)
                        pool = new_pool(gpu_of.pop(pool))
                    idle.append(pool)
                    if outcome["status"] == "failed":
                        result.failed[rid] = outcome["error"]
                    else:
                        (result.done if outcome["status"] == "done" else result.skipped).append(rid)
                    progress.finished(rid, outcome["status"], outcome.get("summary"), outcome.get("error"))
                progress.poll(lambda rid: rounds_logged(run_dir(study, rid)))
    except BaseException:  # Ctrl-C, SIGTERM: stop the running runs (rerunning resumes them)
        _stop_workers([pool for _, pool in running.values()])
        raise
    finally:
        for pool in [*idle, *(pool for _, pool in running.values())]:
            pool.shutdown(wait=True, cancel_futures=True)
        if previous is not None:
            signal.signal(signal.SIGTERM, previous)
