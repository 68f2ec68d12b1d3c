"""The command line: errors name the field or file; epsilon reproduces the papers' budgets."""

import json
from pathlib import Path

import pytest

from fedprivacy.cli import main
from fedprivacy.config import RunConfig, load_config

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
