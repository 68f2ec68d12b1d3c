"""One state file and one list of settings a resume may not change (the strategy's settings plus the run's config
fields), and state written before that format still resuming bit-identically: a ``fedprivacy run`` folder's
``checkpoint.pt`` as the former run loop wrote it (a fixture written by that code: a 2-round run of the small
config with 50 words and 5 tags; its data path made relative), and a user strategy's ``strategy.pt`` (version 2)."""

import shutil
from pathlib import Path

import pytest
import torch

from fedprivacy.checkpoints import ResumeError, atomic_save, load_checkpoint
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.fl.strategy_state import LEGACY_STATE, STATE
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

from test_strategy import _flat, _plain_client_app, _start  # this folder is on sys.path (pytest's rootdir mode)
from test_strategy_state import SETTINGS

FORMER_RUN = Path(__file__).parent / "fixtures" / "checkpoint_v1"
SMALL = ("data.vocab_size=50", "data.num_tags=5")


def _former_run(tmp_path: Path) -> Path:
    folder = tmp_path / "former"
    shutil.copytree(FORMER_RUN, folder)
    return folder


def test_a_run_checkpointed_in_the_former_format_resumes_bit_identically(small_config, tmp_path):
    former = _former_run(tmp_path)
    assert "version" not in load_checkpoint(former / STATE)  # what the former run loop wrote
    resumed = run(small_config("rounds=4", *SMALL, f"output_dir={former}"), resume=True)
    fresh = run(small_config("rounds=4", *SMALL, f"output_dir={tmp_path / 'fresh'}"))
    a, b = load_checkpoint(former / STATE), load_checkpoint(tmp_path / "fresh" / STATE)
    assert torch.equal(a["params"], b["params"]) and a["ledger"] == b["ledger"]
    assert a["version"] == b["version"] == 3 and a["settings"] == b["settings"]
    assert [e["release"] for e in ReleaseLog(former).entries] == [1, 2, 3, 4]
    assert resumed["epsilon_rdp"] == fresh["epsilon_rdp"] and resumed["rounds_completed"] == 4
    assert [r["round"] for r in a["metrics"]] == [1, 2, 3, 4]  # the former rows kept, then the new ones


@pytest.mark.parametrize("override, field", [("privacy.clip_norm=2.0", "config.privacy.clip_norm: 1.0 -> 2.0"),
                                             ("data.num_tags=6", "config.data.num_tags: 5 -> 6"),
                                             ("seed=3", "config.seed: 0 -> 3")])
def test_a_run_in_the_former_format_refuses_a_changed_fixed_field_naming_it(small_config, tmp_path, override, field):
    former = _former_run(tmp_path)
    with pytest.raises(ResumeError, match=field):
        run(small_config("rounds=4", *SMALL, override, f"output_dir={former}"), resume=True)
    assert "version" not in load_checkpoint(former / STATE)  # nothing was written


@pytest.mark.parametrize("override, field", [("privacy.accountants=[rdp]", "config.privacy.accountants"),
                                             ("server.lr=2.0", "lr: 1.0 -> 2.0")])
def test_a_resume_refuses_a_changed_config_field_or_strategy_setting_naming_it(small_config, tmp_path, override, field):
    run(small_config("rounds=1", *SMALL, f"output_dir={tmp_path / 'run'}"))
    before = (tmp_path / "run" / STATE).read_bytes()
    with pytest.raises(ResumeError, match=field):
        run(small_config("rounds=2", *SMALL, override, f"output_dir={tmp_path / 'run'}"), resume=True)
    assert (tmp_path / "run" / STATE).read_bytes() == before


def test_a_resume_evaluates_only_the_rounds_it_runs(small_config, tmp_path, monkeypatch):
    """Flower's loop calls ``evaluate_fn`` at the round a start begins from: the run's evaluation skips it (that
    model was evaluated when its round ran), so a resume adds no evaluation."""
    run(small_config("rounds=2", *SMALL, f"output_dir={tmp_path / 'run'}"))  # eval_every=1
    cfg = small_config("rounds=3", *SMALL, f"output_dir={tmp_path / 'run'}")
    task_cls, calls = type(load_task(cfg.data)), []
    original = task_cls.evaluate
    monkeypatch.setattr(task_cls, "evaluate", lambda self, model: calls.append(1) or original(self, model))
    run(cfg, resume=True)
    assert len(calls) == 1  # round 3's
    assert [r["round"] for r in load_checkpoint(tmp_path / "run" / STATE)["metrics"]] == [1, 2, 3]


def test_a_strategy_state_of_version_2_resumes_bit_identically(tmp_path):
    full = _start(DPFedAvg(**SETTINGS, seed=0), _plain_client_app(), 8, rounds=4, lr=0.5)
    _start(DPFedAvg(**SETTINGS, seed=0, state_dir=tmp_path), _plain_client_app(), 8, rounds=2, lr=0.5)
    state = load_checkpoint(tmp_path / STATE)
    (tmp_path / STATE).unlink()
    atomic_save({**state, "version": 2}, tmp_path / LEGACY_STATE)  # the former file: its name, its number
    restarted = DPFedAvg(**SETTINGS, seed=0, state_dir=tmp_path)
    result = _start(restarted, _plain_client_app(), 8, rounds=4, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(full.arrays)) and restarted.mechanism.ledger.rounds == 4
    assert load_checkpoint(tmp_path / STATE)["round"] == 4


def test_a_file_of_no_known_format_is_refused_naming_it(tmp_path):
    atomic_save({"round": 1}, tmp_path / STATE)
    with pytest.raises(ResumeError, match=f"{tmp_path / STATE} is not a DPFedAvg state"):
        DPFedAvg(**SETTINGS, seed=0, state_dir=tmp_path)
