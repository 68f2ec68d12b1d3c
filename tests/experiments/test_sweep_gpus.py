"""``fedprivacy compare`` on GPUs (faked: ``torch.cuda`` monkeypatched): one worker per GPU by default,
worker i on GPU i mod n through its own ``CUDA_VISIBLE_DEVICES``, and a study it cannot place refused."""

import json
import os
import time
from pathlib import Path

import pytest

from fedprivacy.config import config_from_json
from fedprivacy.devices import DeviceUnavailableError
from fedprivacy.experiments import load_study, sweep
from fedprivacy.experiments.study import expand
from fedprivacy.experiments.sweep import SweepResult, _run_parallel, run_sweep


@pytest.fixture
def planned(monkeypatch):
    """What ``run_sweep`` hands its workers: ``(jobs, gpus)`` (nothing runs)."""
    seen = {}
    monkeypatch.setattr(sweep, "prepare_data", lambda specs: None)
    monkeypatch.setattr(sweep, "_run_parallel", lambda study, specs, todo, jobs, result, progress, gpus:
                        seen.update(jobs=jobs, gpus=gpus))
    monkeypatch.setattr(sweep, "usable_cores", lambda: 5)
    return seen


def test_cuda_study_gets_one_worker_per_gpu_unless_jobs_says_otherwise(tiny_study, fake_gpus, planned):
    fake_gpus(2)
    study = load_study(tiny_study(), ["base.device=cuda"])
    run_sweep(study, show_progress=False)
    assert planned == {"jobs": 2, "gpus": ["0", "1"]}
    run_sweep(study, jobs=3, show_progress=False)
    assert planned == {"jobs": 3, "gpus": ["0", "1", "0"]}


def test_cpu_study_keeps_one_worker_per_core(tiny_study, fake_gpus, planned):
    fake_gpus(2)
    run_sweep(load_study(tiny_study()), show_progress=False)
    assert planned == {"jobs": 5, "gpus": None}


def test_cuda_study_without_a_gpu_is_refused_before_any_run(tiny_study, fake_gpus, planned):
    fake_gpus(0, build_cuda=None)
    study = load_study(tiny_study(), ["base.device=cuda"])
    with pytest.raises(DeviceUnavailableError, match="device='cuda', but the installed torch"):
        run_sweep(study, show_progress=False)
    assert planned == {} and not (Path(study.output_dir) / "runs").exists()


def _record_visible_gpus(run_id: str, config_json: str) -> dict:
    """A sweep worker's target: note the GPU this worker sees, in the run's folder."""
    folder = Path(config_from_json(config_json).output_dir)
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "gpu.json").write_text(json.dumps({"pid": os.getpid(), "gpu": os.environ.get("CUDA_VISIBLE_DEVICES")}))
    time.sleep(0.3)  # both workers take a run before either is free again
    return {"run_id": run_id, "status": "done", "summary": {"rounds_completed": 4}}


@pytest.mark.slow
def test_each_worker_process_sees_only_its_gpu(tiny_study):
    study = load_study(tiny_study(), ["base.device=cuda"])
    specs = expand(study)
    result, before = SweepResult(), os.environ.get("CUDA_VISIBLE_DEVICES")
    _run_parallel(study, specs, specs, 2, result, False, target=_record_visible_gpus, gpus=["3", "GPU-5e1c"])
    assert sorted(result.done) == sorted(s.run_id for s in specs)
    seen = [json.loads((Path(s.config.output_dir) / "gpu.json").read_text()) for s in specs]
    by_worker = {}
    for s in seen:
        by_worker.setdefault(s["pid"], set()).add(s["gpu"])
    assert sorted(by_worker.values(), key=str) == [{"3"}, {"GPU-5e1c"}]  # one GPU per worker, both used
    assert os.environ.get("CUDA_VISIBLE_DEVICES") == before  # set in the workers only
