"""Real sweeps on tiny data: parallel runs, resume, refusing a changed study, kill and restart."""

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pandas as pd
import pytest

from fedprivacy.experiments import compare, load_study
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.experiments.results import load_results, without_wall_time
from fedprivacy.experiments.study import expand
from fedprivacy.experiments.sweep import (StudyChangedError, SweepBusyError, SweepResult, _run_parallel, rounds_logged,
                                         run_state, run_sweep)
from fedprivacy.experiments import sweep
from fedprivacy.locks import locked
from fedprivacy.checkpoints import load_checkpoint
from fedprivacy.outputs import CHECKPOINT

pytestmark = pytest.mark.slow


def _tables(folder: Path) -> dict[str, pd.DataFrame]:
    r = load_results(folder)
    return {name: without_wall_time(getattr(r, name)).sort_values(
        [c for c in ("run_id", "method", "budget", "hparams", "round") if c in getattr(r, name)]).reset_index(drop=True)
        for name in ("rounds", "runs", "grid", "summary")}


def test_sweep_runs_everything_then_skips_it_and_refuses_a_changed_study(tiny_study):
    study = load_study(tiny_study())
    result, report = compare(study, jobs=2, show_progress=False)
    specs = expand(study)
    assert sorted(result.done) == sorted(s.run_id for s in specs) and not result.failed
    r = load_results(study.output_dir)
    assert len(r.rounds) == 4 * len(specs) and r.runs["finished"].all()
    assert set(r.summary["method"]) == {"DP-FedAvg", "DP-FedAdam"}
    assert (r.summary["epsilon_rdp"] <= 8).all() and (r.summary["epsilon_rdp"] > 7.9).all()  # calibrated to eps 8
    assert r.summary["epsilon_prv"].notna().all()  # from the ledger, though the runs tracked rdp and pld only
    assert report.exists() and "DP-FedAdam" in report.read_text()

    again = run_sweep(study, jobs=2, show_progress=False)  # a finished study: nothing runs again
    assert sorted(again.skipped) == sorted(s.run_id for s in specs) and not again.done

    changed = load_study(tiny_study(), ["methods.DP-FedAdam.set.server.lr=0.02"])
    with pytest.raises(StudyChangedError, match=r"DP-FedAdam__eps8__default__s0.*server.lr: 0.01 -> 0.02"):
        run_sweep(changed, jobs=1, show_progress=False)
    extended = load_study(tiny_study(), ["seeds=[0,1,2]"])  # new runs are added, old ones kept
    more = run_sweep(extended, jobs=2, show_progress=False)
    assert len(more.done) == 3 and len(more.skipped) == len(specs)


def test_a_second_sweep_on_the_same_folder_is_refused(tiny_study):
    study = load_study(tiny_study())
    with locked(Path(study.output_dir) / ".sweep.lock", blocking=False):
        with pytest.raises(SweepBusyError, match=f"pid {os.getpid()}"):
            run_sweep(study, jobs=1, show_progress=False)


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "fedprivacy", "compare", *args]


def test_killed_sweep_restarts_where_it_stopped_and_matches_an_uninterrupted_one(tiny_study, tmp_path):
    path = tiny_study(base={**load_study(tiny_study()).base, "rounds": 12})
    study = load_study(path)
    runs = Path(study.output_dir) / "runs"
    proc = subprocess.Popen(_cli(str(path), "--jobs", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline, states = time.time() + 240, {}
    while time.time() < deadline and proc.poll() is None:
        states = {s.run_id: run_state(runs / s.run_id) for s in expand(study)}
        early = [r for r, s in states.items() if s == "partial" and rounds_logged(runs / r) <= 8]  # far from done
        if "finished" in states.values() and early:
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGKILL)  # no chance to clean up: the workers must notice and stop
    proc.wait()
    finished = sorted(r for r, s in states.items() if s == "finished")
    partial = sorted(r for r, s in states.items() if s == "partial")
    assert finished and partial
    for rid in partial:  # the orphaned workers exit and release their runs
        with open(runs / rid / ".lock", "a+") as f:
            for _ in range(100):
                try:
                    fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
                    break
                except BlockingIOError:
                    time.sleep(0.1)
            else:
                pytest.fail(f"a worker of the killed sweep still holds {rid}")
    stamps = {rid: (runs / rid / "summary.json").stat().st_mtime_ns for rid in finished}

    done = subprocess.run(_cli(str(path), "--jobs", "2"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for rid in finished:  # finished runs were not rerun
        assert (runs / rid / "summary.json").stat().st_mtime_ns == stamps[rid]
        assert len(json.loads((runs / rid / "sweep_run.json").read_text())["attempts"]) == 1
    resumed = [json.loads((runs / rid / "sweep_run.json").read_text())["attempts"] for rid in partial]
    assert any(len(a) == 2 and 0 < a[1]["start_round"] < 12 for a in resumed)  # continued from a checkpoint

    fresh = tmp_path / "uninterrupted"
    full = subprocess.run(_cli(str(path), "--jobs", "2", "--set", f"output_dir={fresh}"), capture_output=True,
                          text=True, timeout=600)
    assert full.returncode == 0, full.stderr[-3000:]
    # A run killed between a release and its next checkpoint re-runs that round with a fresh draw and
    # cohort (epoch 1 of its write-ahead log) and accounts both releases: it must NOT match the
    # uninterrupted run (it spent more), and every other run must match it exactly.
    rekeyed = {s.run_id for s in expand(study)  # also a run that started between the last look and the kill
               if any(e["epoch"] for e in ReleaseLog(runs / s.run_id).entries)}
    for rid in rekeyed:
        summary = json.loads((runs / rid / "summary.json").read_text())
        assert summary["releases"] > summary["rounds_completed"]
    killed, clean = _tables(Path(study.output_dir)), _tables(fresh)
    for name in killed if not rekeyed else ("rounds", "runs"):  # grid and summary average over the runs
        keep_k, keep_c = (~t["run_id"].isin(rekeyed) if rekeyed else slice(None) for t in (killed[name], clean[name]))
        pd.testing.assert_frame_equal(killed[name][keep_k].reset_index(drop=True),
                                      clean[name][keep_c].reset_index(drop=True), check_exact=True, obj=name)


def test_sigterm_stops_a_sweep_between_rounds_with_nothing_lost(tiny_study):
    """SIGTERM to the sweep: each running run finishes its round and checkpoints (none is scheduled before the
    end here), so the rerun completes every run's 12 rounds within its budget, where a killed run would have
    spent releases past its last checkpoint and stopped short of them."""
    path = tiny_study(base={**load_study(tiny_study()).base, "rounds": 12, "checkpoint_every": 1000})
    study = load_study(path)
    runs = Path(study.output_dir) / "runs"
    proc = subprocess.Popen(_cli(str(path), "--jobs", "2"), stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    deadline = time.time() + 240
    while time.time() < deadline and proc.poll() is None:
        if any(2 <= rounds_logged(runs / s.run_id) <= 8 for s in expand(study) if (runs / s.run_id).is_dir()):
            break
        time.sleep(0.05)
    assert proc.poll() is None, proc.stderr.read().decode()[-2000:]
    proc.send_signal(signal.SIGTERM)
    _, err = proc.communicate(timeout=180)
    assert proc.returncode == 130, err.decode()[-2000:]
    stopped = [s.run_id for s in expand(study) if run_state(runs / s.run_id) == "partial"]
    assert stopped
    for rid in stopped:  # the checkpoint holds every round logged and every release made
        saved = load_checkpoint(runs / rid / CHECKPOINT)
        assert len(saved["metrics"]) == rounds_logged(runs / rid) > 0
        assert max(e["release"] for e in ReleaseLog(runs / rid).entries) == len(saved["metrics"])
    done = subprocess.run(_cli(str(path), "--jobs", "2"), capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    for s in expand(study):
        summary = json.loads((runs / s.run_id / "summary.json").read_text())
        assert (summary["rounds_completed"], summary["releases"], summary["stop_reason"]) == (12, 12, "rounds")


_ORPHAN_PARENT = """
import multiprocessing, os, sys, time
from concurrent.futures import ProcessPoolExecutor
from fedprivacy.experiments.sweep import _init_worker
if __name__ == "__main__":
    ctx = multiprocessing.get_context("spawn")
    pool = ProcessPoolExecutor(1, mp_context=ctx, initializer=_init_worker, initargs=(None, os.getpid(), None))
    print(pool.submit(os.getpid).result(), flush=True)
    time.sleep(60)
"""


def _alive(pid: int) -> bool:
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(") ")[1][0] not in "ZX"
    except (FileNotFoundError, IndexError):
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_worker_dies_at_once_with_its_sweep():
    """SIGKILL of the sweep kills its worker within 0.3 s (the fallback poll takes up to 0.5 s): an orphan
    cannot go on running rounds, or finish a run, for a sweep that no longer exists."""
    parent = subprocess.Popen([sys.executable, "-c", _ORPHAN_PARENT], stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                              text=True)
    worker = int(parent.stdout.readline())
    time.sleep(0.6)  # past the fallback watcher's first check
    assert _alive(worker)
    parent.send_signal(signal.SIGKILL)
    parent.wait()
    deadline = time.monotonic() + 0.3
    while _alive(worker) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not _alive(worker)


DOOMED = "DP-FedAdam__eps8__default__s0"


def _run_or_die(run_id: str, config_json: str) -> dict:
    """A sweep worker's target: the doomed run's worker is killed (as for memory), the others finish."""
    if run_id == DOOMED:
        os.kill(os.getpid(), signal.SIGKILL)
    time.sleep(0.2)  # the killed worker's neighbour is still running when it dies
    return {"run_id": run_id, "status": "done", "summary": {"rounds_completed": 4}}


def test_a_killed_worker_fails_only_its_own_run(tiny_study):
    study = load_study(tiny_study())
    specs = expand(study)
    assert DOOMED in {s.run_id for s in specs}
    result = SweepResult()
    _run_parallel(study, specs, specs, 2, result, False, target=_run_or_die)
    assert list(result.failed) == [DOOMED] and "worker process died" in result.failed[DOOMED]
    assert sorted(result.done) == sorted(s.run_id for s in specs if s.run_id != DOOMED)


def test_a_run_with_a_corrupt_checkpoint_fails_alone_naming_the_file(tiny_study, monkeypatch):
    study = load_study(tiny_study())
    spec = expand(study)[0]
    folder = Path(spec.config.output_dir)
    folder.mkdir(parents=True)
    (folder / "checkpoint.pt").write_bytes(b"not a checkpoint")
    monkeypatch.setattr(sweep, "_log_to", lambda path: None)  # keep this process's logging as it is
    outcome = sweep.execute(spec.run_id, spec.config.to_json())
    assert outcome["status"] == "failed" and f"{folder / 'checkpoint.pt'} is not a readable checkpoint" in outcome["error"]


def test_runs_that_would_use_every_core_share_them_between_the_jobs(monkeypatch):
    from fedprivacy.config import build_config
    from fedprivacy.engines import processes
    from fedprivacy.experiments.sweep import cores_per_run

    monkeypatch.setattr(processes, "usable_cores", lambda: 8)
    monkeypatch.setattr(sweep, "usable_cores", lambda: 8)
    every_core = build_config({})
    assert every_core.processes is None and processes.run_processes(every_core) == 8
    assert [cores_per_run(every_core, jobs).processes for jobs in (1, 2, 3, 8, 16)] == [8, 4, 2, 1, 1]
    assert cores_per_run(build_config({"processes": 3}), 2).processes == 3  # named: kept
    assert cores_per_run(build_config({"engine": "ray"}), 2).processes is None  # not the in-process CPU engine
    assert cores_per_run(every_core, 2).model_copy(update={"processes": None}) == every_core  # nothing else changes
