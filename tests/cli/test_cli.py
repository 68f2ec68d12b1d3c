"""The command line: errors name the field or file; epsilon reproduces the papers' budgets."""

import errno
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml

from fedprivacy.cli import main
from fedprivacy.config import DataConfig, RunConfig, load_config
from fedprivacy.stackoverflow_tasks import data_provenance, may_generate

REPO = Path(__file__).resolve().parents[2]


def test_quickstart_yaml_spells_out_exactly_the_embedded_defaults():
    assert load_config(REPO / "configs" / "quickstart.yaml") == RunConfig()


def test_unknown_config_field_is_named(tmp_path, capsys):
    cfg = tmp_path / "bad.yaml"
    cfg.write_text("privacy:\n  noise_multplier: 1.0\n")
    assert main(["run", str(cfg)]) == 2
    err = capsys.readouterr().err
    assert "privacy.noise_multplier" in err and "unknown field" in err


def test_invalid_override_value_is_named(capsys):
    assert main(["run", "--set", "privacy.clip_norm=-1"]) == 2
    assert "privacy.clip_norm" in capsys.readouterr().err


def test_fixed_sampling_requires_rdp_only(capsys):
    assert main(["run", "--set", "privacy.sampling=fixed"]) == 2
    assert "privacy.accountants" in capsys.readouterr().err


def test_missing_config_file_is_named(tmp_path, capsys):
    assert main(["run", str(tmp_path / "nope.yaml")]) == 2
    assert "nope.yaml" in capsys.readouterr().err


def test_missing_data_file_is_named(tmp_path, capsys):
    args = ["run", "--set", f"data.path={tmp_path / 'so'}", "--set", "data.generate_if_missing=false",
            "--set", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert str(tmp_path / "so" / "stackoverflow.sqlite") in err


def test_corrupt_data_file_is_named(tmp_path, capsys):
    folder = tmp_path / "so"
    folder.mkdir()
    for name in ("stackoverflow.sqlite", "stackoverflow.word_count", "stackoverflow.tag_count"):
        (folder / name).write_text("not what it should be\n")
    args = ["run", "--set", f"data.path={folder}", "--set", f"output_dir={tmp_path / 'run'}"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert "stackoverflow" in err and str(folder) in err


def _epsilon(capsys, *args):
    assert main(["epsilon", *args]) == 0
    return json.loads(capsys.readouterr().out)["epsilon"]


def test_epsilon_reproduces_adadps_federated_budget(capsys):
    base = ["--sampling", "poisson", "--q", str(20 / 400), "--noise-multiplier", "0.3", "--steps", "40",
            "--delta", str(1 / 400), "--accountant", "rdp"]
    assert _epsilon(capsys, *base)["rdp"] == pytest.approx(33.45, abs=0.01)
    from fedprivacy.privacy.accounting import ADADPS_RDP_ORDERS

    orders = ",".join(str(o) for o in ADADPS_RDP_ORDERS)
    assert _epsilon(capsys, *base, "--orders", orders)["rdp"] == pytest.approx(34.17, abs=0.01)


def test_epsilon_reproduces_dp_microadam_cifar10_budget(capsys):
    eps = _epsilon(capsys, "--sampling", "poisson", "--q", str(4096 / 45000), "--noise-multiplier", "3",
                   "--steps", "2480", "--delta", "1e-5", "--accountant", "rdp")
    assert eps["rdp"] == pytest.approx(7.9996, abs=1e-3)


def test_epsilon_all_accountants_and_fixed_sampling(capsys):
    eps = _epsilon(capsys, "--sampling", "poisson", "--q", "0.01", "--noise-multiplier", "1.0", "--steps", "100",
                   "--delta", "1e-5")
    assert set(eps) == {"rdp", "prv", "pld"} and eps["pld"] <= eps["rdp"]
    fixed = _epsilon(capsys, "--sampling", "fixed", "--q", "0.01", "--population", "10000",
                     "--noise-multiplier", "1.0", "--steps", "100", "--delta", "1e-5", "--accountant", "rdp")
    assert fixed["rdp"] > eps["rdp"]  # replace-one neighbours cost more than add/remove-one


def test_data_generate_writes_the_tff_files(tmp_path, capsys):
    assert main(["data", "generate", "--out", str(tmp_path / "so"), "--clients", "5", "--seed", "3"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert all(Path(p).exists() for p in out.values())


def _one_line_error(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert err.startswith("fedprivacy: error: ") and "\n" not in err and "Traceback" not in err, err
    return err


def test_a_typo_in_data_path_is_an_error_not_generated_data(tmp_path, capsys):
    typo = tmp_path / "synthetc"
    assert main(["run", "--set", f"data.path={typo}", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    assert str(typo / "stackoverflow.sqlite") in _one_line_error(capsys) and not typo.exists()


@pytest.mark.parametrize("path, flag, allowed", [
    ("data/synthetic", None, True), ("./data/synthetic", None, True), ("data/synthetc", None, False),
    ("data/synthetc", True, True), ("data/synthetic", False, False),
])
def test_data_is_generated_only_into_the_default_folder_or_when_asked(path, flag, allowed):
    assert may_generate(DataConfig(path=path, generate_if_missing=flag)) is allowed


def test_data_provenance_names_the_files_and_whether_they_are_synthetic(small_config, tmp_path):
    cfg = small_config().data
    provenance = data_provenance(cfg)
    assert provenance["synthetic"] and provenance["generator"]["seed"] == 1 and provenance["source"] == "tff-sqlite"
    assert set(provenance["files"]) == {"stackoverflow.sqlite", "stackoverflow.word_count", "stackoverflow.tag_count"}
    assert all(len(f["sha256_head_tail"]) == 64 and f["size"] > 0 for f in provenance["files"].values())
    real = tmp_path / "real"
    real.mkdir()
    for name in provenance["files"]:
        (real / name).write_bytes((cfg.path / name).read_bytes())
    assert not data_provenance(cfg.model_copy(update={"path": real}))["synthetic"]


def test_an_output_dir_that_is_a_file_is_one_line(tmp_path, capsys, small_config):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(json.loads(small_config().to_json())))
    (tmp_path / "taken").write_text("")
    for out in (tmp_path / "taken", tmp_path / "taken" / "run"):
        assert main(["run", str(config), "--set", f"output_dir={out}"]) == 2
        assert f"{out}: " in _one_line_error(capsys)


def test_an_unreadable_data_folder_is_one_line(tmp_path, capsys, monkeypatch):
    def denied(self, *args, **kwargs):
        raise PermissionError(errno.EACCES, os.strerror(errno.EACCES), str(self))

    monkeypatch.setattr(Path, "exists", denied)
    assert main(["run", "--set", f"data.path={tmp_path / 'so'}", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    assert "Permission denied (check the permissions)" in _one_line_error(capsys)


def test_a_garbage_word_count_file_is_named(small_data, tmp_path, capsys):
    folder = tmp_path / "so"
    folder.mkdir()
    for name in ("stackoverflow.sqlite", "stackoverflow.tag_count"):
        (folder / name).write_bytes((small_data / name).read_bytes())
    (folder / "stackoverflow.word_count").write_bytes(bytes(range(256)) * 4)
    assert main(["run", "--set", f"data.path={folder}", "--set", f"output_dir={tmp_path / 'run'}"]) == 2
    assert f"{folder / 'stackoverflow.word_count'}: not UTF-8 text" in _one_line_error(capsys)


@pytest.mark.parametrize("checkpointed", [True, False])
def test_ctrl_c_prints_one_line_with_the_command_that_resumes(tmp_path, capsys, monkeypatch, checkpointed):
    def interrupted(cfg, resume, on_round=None):
        if checkpointed:
            (cfg.output_dir / "checkpoint.pt").write_bytes(b"")
        raise KeyboardInterrupt

    monkeypatch.setattr("fedprivacy.run.run", interrupted)
    (tmp_path / "run").mkdir()
    config = tmp_path / "my run.yaml"
    config.write_text(f"output_dir: {tmp_path / 'run'}\n")
    assert main(["run", str(config), "--set", "rounds=5"]) == 130
    err = capsys.readouterr().err.strip()
    assert "\n" not in err and "Traceback" not in err
    if checkpointed:
        assert err.endswith(f"fedprivacy run '{config}' --set=rounds=5 --resume")
    else:
        assert "before the run's first checkpoint" in err


@pytest.mark.slow
def test_ctrl_c_of_a_real_run_exits_130_with_one_line(small_config, tmp_path):
    config = tmp_path / "run.yaml"
    config.write_text(yaml.safe_dump(json.loads(small_config("rounds=100000").to_json())))
    proc = subprocess.Popen([sys.executable, "-m", "fedprivacy", "run", str(config)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,  # Ctrl-C's default even where the test's shell
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))  # ignores it (a job in &)
    deadline = time.time() + 120
    while not (tmp_path / "run" / "checkpoint.pt").exists() and time.time() < deadline:
        time.sleep(0.1)
    proc.send_signal(signal.SIGINT)
    _, err = proc.communicate(timeout=60)
    assert proc.returncode == 130 and "Traceback" not in err, err[-3000:]
    assert err.strip().splitlines()[-1] == f"fedprivacy: interrupted; resume the run with: fedprivacy run {config} --resume"
