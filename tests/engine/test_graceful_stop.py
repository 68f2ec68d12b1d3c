"""A run asked to stop (SIGTERM) finishes its round, checkpoints and resumes with nothing lost: the same model
and ledger as a run never stopped, where a kill costs the releases made after the last checkpoint."""

import json

import pytest
import torch

from fedprivacy.checkpoints import load_checkpoint
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.run import run
from fedprivacy.stopping import RunStopped, request_stop, stop_requested


def _stop_after(round_: int):
    def on_round(t: int, row: dict) -> None:
        if t == round_:
            request_stop()
    return on_round


def test_a_stopped_run_checkpoints_its_last_round_and_resumes_bit_identically(small_config, tmp_path):
    cfg = small_config("rounds=5", "checkpoint_every=1000", f"output_dir={tmp_path / 'stopped'}")
    with pytest.raises(RunStopped, match="after round 2"):
        run(cfg, on_round=_stop_after(2))
    saved = load_checkpoint(tmp_path / "stopped" / "checkpoint.pt")  # written by the stop, not the schedule
    assert saved["ledger"]["entries"] and len(saved["metrics"]) == 2
    assert [e["release"] for e in ReleaseLog(tmp_path / "stopped").entries] == [1, 2]  # nothing beyond it
    assert not (tmp_path / "stopped" / "summary.json").exists()

    resumed = run(cfg, resume=True)
    assert not stop_requested()  # a run starts with no stop asked
    clean = run(small_config("rounds=5", "checkpoint_every=1000", f"output_dir={tmp_path / 'clean'}"))
    assert resumed["rounds_completed"] == resumed["releases"] == 5 == clean["releases"]
    a, b = (load_checkpoint(tmp_path / d / "checkpoint.pt") for d in ("stopped", "clean"))
    assert torch.equal(a["params"], b["params"]) and a["ledger"] == b["ledger"]
    assert json.loads((tmp_path / "stopped" / "summary.json").read_text())["epsilon_rdp"] == clean["epsilon_rdp"]


def test_a_stop_asked_in_the_last_round_lets_the_run_finish(small_config):
    summary = run(small_config("rounds=3"), on_round=_stop_after(3))
    assert summary["rounds_completed"] == 3 and summary["stop_reason"] == "rounds"
