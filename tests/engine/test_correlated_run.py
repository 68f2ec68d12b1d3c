"""Correlated noise everywhere a user runs DP (issue "Correlated noise", item 3): ``fedprivacy run`` with
``privacy.mechanism``, a hand-written ServerApp with ``DPFedAvg(noise_stream=CorrelatedMechanism(...))``, resume
(seeded: the same correlated stream, bit for bit; from the OS: a new strategy, accounted anew), calibration,
and the combinations refused naming the settings."""

import csv

import dp_accounting
import numpy as np
import pytest
import torch
from dp_accounting import rdp

from fedprivacy import answer_identity_query
from fedprivacy.checkpoints import load_checkpoint
from fedprivacy.config import ConfigError
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.fl.strategy_state import StrategyState
from fedprivacy.privacy.accounting import CoveredRelease, MatrixMechanismRun, epsilon
from fedprivacy.privacy.correlated import CorrelatedMechanism
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.run import run

from test_one_round import run_and_hand_written  # this folder is on sys.path (pytest's rootdir mode)

from test_strategy import _flat, _plain_client_app, _start

BLT = ("privacy.sampling=min_separated", "privacy.groups=2", "privacy.mechanism.kind=blt",
       "privacy.mechanism.buffers=2", "privacy.expected_cohort=6")


def test_fedprivacy_run_with_blt_accounts_one_gaussian_and_releases_its_per_round_std(small_config):
    cfg = small_config("rounds=4", *BLT)
    summary = run(cfg)
    spec = CorrelatedMechanism(kind="blt", horizon=4, groups=2, buffers=2)
    stream = spec(0)
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert summary["epsilon_rdp"] == pytest.approx(
        accountant.compose(dp_accounting.GaussianDpEvent(cfg.privacy.noise_multiplier)).get_epsilon(summary["delta"]),
        rel=1e-6)
    with open(cfg.output_dir / "metrics.csv") as f:
        stds = [float(row["server_noise_std"]) for row in csv.DictReader(f)]
    zc = cfg.privacy.noise_multiplier * cfg.privacy.clip_norm
    assert stds == pytest.approx([zc * stream.std_factor(t) for t in range(1, 5)])
    logged = [e["event"] for e in ReleaseLog(cfg.output_dir).entries]
    assert logged[0] == MatrixMechanismRun(cfg.privacy.noise_multiplier, "blt", 4, 2, 2)
    assert [type(e).__name__ for e in logged[1:]] == ["CoveredRelease"] * 3


def test_a_hand_written_server_app_with_blt_is_bit_identical_to_fedprivacy_run(small_config, tmp_path):
    cfg = small_config("rounds=3", f"output_dir={tmp_path / 'run'}", *BLT)
    strategy, saved = run_and_hand_written(
        cfg, optimizer_settings={"momentum": 0.9}, sampling="min_separated", groups=2,
        noise_stream=CorrelatedMechanism(kind="blt", horizon=3, groups=2, buffers=2))
    assert torch.equal(strategy.params, saved["params"])
    assert strategy.mechanism.ledger.state_dict() == saved["ledger"]


def _identified_client_app():
    """The stock ClientApp, answering the identity query a cyclic schedule with ``state_dir`` asks."""
    return answer_identity_query(_plain_client_app())


@pytest.mark.parametrize("spec", [CorrelatedMechanism(kind="tree", horizon=4, groups=2),
                                  CorrelatedMechanism(kind="bandmf", horizon=6, groups=2, bands=2, amplified=True),
                                  CorrelatedMechanism(kind="blt", horizon=6, groups=2, buffers=2)])
def test_a_seeded_restart_continues_the_same_correlated_stream_bit_for_bit(tmp_path, spec):
    sampling = "cyclic_poisson" if spec.amplified else "min_separated"
    settings = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=2, population=8, delta=1e-3, seed=0,
                    sampling=sampling, groups=2, noise_stream=spec)
    full = _start(DPFedAvg(**settings), _plain_client_app(), 8, rounds=5, lr=0.5)
    _start(DPFedAvg(**settings, state_dir=tmp_path), _identified_client_app(), 8, rounds=3, lr=0.5)
    restarted = DPFedAvg(**settings, state_dir=tmp_path)
    result = _start(restarted, _identified_client_app(), 8, rounds=5, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(full.arrays))
    with pytest.raises(Exception, match="noise_stream"):
        DPFedAvg(**{**settings, "noise_stream": CorrelatedMechanism(kind="tree", horizon=8, groups=2)},
                 state_dir=tmp_path)


def test_a_restart_from_the_os_begins_a_new_strategy_and_accounts_it(tmp_path):
    spec = CorrelatedMechanism(kind="blt", horizon=6, groups=2, buffers=2)
    settings = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=2, population=8, delta=1e-3, seed=None,
                    sampling="min_separated", groups=2, noise_stream=spec)
    _start(DPFedAvg(**settings, state_dir=tmp_path), _identified_client_app(), 8, rounds=3, lr=0.5)
    saved = load_checkpoint(tmp_path / "checkpoint.pt")
    assert saved["noise"] is None and saved["sampler"] is None  # no noise (no buffer, no generator) on disk
    assert saved["stream_start"] == 1  # a plain number: how the stream numbered its releases
    restarted = DPFedAvg(**settings, state_dir=tmp_path)
    _start(restarted, _identified_client_app(), 8, rounds=5, lr=0.5)
    runs = [(e, n) for e, n in restarted.mechanism.ledger.entries if isinstance(e, MatrixMechanismRun)]
    assert sum(n for _, n in runs) == 2  # release 1 and release 4: the resumed strategy is a new Gaussian release
    assert restarted.mechanism.stream_start == 4


def test_an_os_noise_blt_run_killed_after_logging_release_4_before_its_checkpoint_resumes(tmp_path, monkeypatch):
    """Before: every restart was refused ("release 4 logs the event CoveredRelease(by=blt) but this run cannot have
    made it there"): the lost release, made by the old stream at its position 4, was checked against a new stream's
    first release. Now it is accounted as logged, and round 4 runs again on a fresh stream, a new horizon."""
    spec = CorrelatedMechanism(kind="blt", horizon=6, groups=2, buffers=2)
    settings = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=2, population=8, delta=1e-3, seed=None,
                    sampling="min_separated", groups=2, noise_stream=spec)
    save = StrategyState.save

    def killed_at_round_4(self, settings, state):  # release 4 is logged (fsynced), its checkpoint never written
        if state["round"] == 4:
            raise KeyboardInterrupt
        save(self, settings, state)
    monkeypatch.setattr(StrategyState, "save", killed_at_round_4)
    with pytest.raises(KeyboardInterrupt):
        _start(DPFedAvg(**settings, state_dir=tmp_path), _identified_client_app(), 8, rounds=6, lr=0.5)
    monkeypatch.setattr(StrategyState, "save", save)
    assert load_checkpoint(tmp_path / "checkpoint.pt")["round"] == 3
    assert ReleaseLog(tmp_path).entries[3]["event"] == CoveredRelease(1.0, "blt")
    restarted = DPFedAvg(**settings, state_dir=tmp_path)
    _start(restarted, _identified_client_app(), 8, rounds=6, lr=0.5)
    entries = ReleaseLog(tmp_path).entries
    assert [(e["round"], e["epoch"]) for e in entries] == [(1, 0), (2, 0), (3, 0), (4, 0), (4, 1), (5, 1), (6, 1)]
    assert [e for e, n in restarted.mechanism.ledger.entries for _ in range(n)] == [e["event"] for e in entries]
    assert [isinstance(e["event"], MatrixMechanismRun) for e in entries] == [k in (1, 5) for k in range(1, 8)]
    assert restarted.mechanism.stream_start == 5 and restarted.round == 6


def test_auto_calibrates_the_correlated_run_to_the_target(small_config):
    cfg = small_config("rounds=4", *BLT, "privacy.noise_multiplier=auto", "privacy.target_epsilon=3",
                       "privacy.accountants=[rdp]")
    summary = run(cfg)
    assert 0.99 * 3 <= summary["epsilon_rdp"] <= 3


@pytest.mark.parametrize(("overrides", "message"), [
    (("privacy.mechanism.kind=tree",), "privacy.mechanism.kind='tree' needs privacy.sampling: min_separated"),
    (("privacy.sampling=min_separated", "privacy.groups=2", "privacy.mechanism.kind=bandmf",
      "privacy.mechanism.bands=3"), "privacy.mechanism.bands=3 must be <= privacy.groups=2"),
    ((*BLT, "server.disk.kappa=0.5"), "server.disk models noise independent across rounds"),
    ((*BLT, "privacy.placement=distributed"), "needs privacy.placement: central"),
    ((*BLT, "privacy.budget_accountant=prv"), "budget_accountant='prv' cannot account"),
    (("privacy.groups=3",), "privacy.groups=3 needs privacy.sampling: cyclic_poisson or min_separated"),
])
def test_unsound_configs_are_refused_naming_the_settings(small_config, overrides, message):
    with pytest.raises(ConfigError, match=message):
        small_config(*overrides)


def test_dp_fedavg_refuses_disk_with_correlated_noise():
    with pytest.raises(ValueError, match="DiSK .* models noise independent across rounds"):
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=2, population=8, seed=0, disk_kappa=0.5,
                 sampling="min_separated", groups=2, noise_stream=CorrelatedMechanism(kind="tree", horizon=4, groups=2))


def test_epsilon_of_the_ledger_matches_the_planned_one(small_config):
    cfg = small_config("rounds=3", *BLT)
    run(cfg)
    ledger = load_checkpoint(cfg.output_dir / "checkpoint.pt")["ledger"]
    from fedprivacy.privacy.accounting import PrivacyLedger

    assert epsilon(PrivacyLedger.from_state_dict(ledger), 1e-3, "pld") > 0


def test_the_cli_accounts_and_calibrates_correlated_mechanisms(capsys):
    import json

    from fedprivacy.cli import main

    common = ["--q", "0.01", "--population", "4000", "--delta", "1e-6", "--sampling", "min_separated",
              "--groups", "4", "--mechanism", "blt", "--buffers", "2"]
    assert main(["epsilon", *common, "--noise-multiplier", "2", "--steps", "40", "--accountant", "rdp"]) == 0
    got = json.loads(capsys.readouterr().out)["epsilon"]["rdp"]
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert got == pytest.approx(accountant.compose(dp_accounting.GaussianDpEvent(2.0)).get_epsilon(1e-6), rel=1e-9)
    assert main(["calibrate", *common, "--target-epsilon", "3", "--steps", "40"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert 0.99 * 3 <= out["epsilon"] <= 3
    assert main(["calibrate", *common, "--target-epsilon", "3", "--noise-multiplier", "2", "--horizon", "8"]) == 0
    out = json.loads(capsys.readouterr().out)  # one Gaussian(2) per 8 releases: the budget allows k horizons
    assert out["epsilon"] <= 3 and out["steps"] % 8 == 0


@pytest.mark.slow
@pytest.mark.parametrize(("variant", "trials"), [("correct", 200), ("noise_halved", 200), ("noise_off", 20)])
def test_the_audit_still_catches_a_broken_server_with_blt_on(variant, trials):
    from fedprivacy.audit import run_audit
    from fedprivacy.config import build_config

    cfg = build_config({"data": {"vocab_size": 200, "num_tags": 10}, "rounds": 8,
                        "privacy": {"clip_norm": 1.0, "noise_multiplier": 2.0, "expected_cohort": 4}},
                       list(BLT[:4]), source="test")
    report = run_audit(cfg, trials=trials, variant=variant)
    assert report.passed == (variant == "correct")


def test_the_correlated_noise_example_runs_learns_and_reports_one_gaussian(tmp_path):
    import re
    import subprocess
    import sys
    from pathlib import Path

    example = Path(__file__).parents[2] / "examples" / "correlated_noise.py"
    out = subprocess.run([sys.executable, str(example)], capture_output=True, text=True, timeout=300, cwd=tmp_path)
    assert out.returncode == 0, out.stderr[-2000:]
    accuracy, eps = map(float, re.search(r"accuracy ([\d.]+) .* epsilon ([\d.]+)", out.stdout).groups())
    accountant = rdp.RdpAccountant(neighboring_relation=dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE)
    assert accuracy > 0.75
    assert eps == pytest.approx(accountant.compose(dp_accounting.GaussianDpEvent(2.0)).get_epsilon(1e-3), abs=0.01)


# -- hardening III: the run's noise_mechanism.json rebuilds C without the Python API ----------------------------
def _from_json(stream) -> dict:
    import json

    return json.loads(json.dumps(stream.describe_strategy()))


def _rebuilt_c(d: dict) -> np.ndarray:
    """The strategy matrix from ``noise_mechanism.json``'s ``strategy`` alone (numpy)."""
    n = d["horizon"]
    if d["kind"] == "tree":
        rows = np.zeros((len(d["nodes"]), n))
        for row, (first, last) in zip(rows, d["nodes"]):
            row[first - 1:last] = 1.0
        return rows
    c = np.zeros(n)
    c[:len(d["coefficients"])] = d["coefficients"][:n]
    return np.array([[c[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])


def _released_noise(stream, draws: list) -> np.ndarray:
    """Releases 1..n of ``stream`` at z C = 1 with the draws scripted (its rows: s(C) (C^{-1} w)_t)."""
    queue = iter(draws)
    stream._fresh = lambda like: torch.tensor(next(queue))
    out = []
    for t in range(1, stream.horizon + 1):
        x = torch.zeros(len(draws[0]), dtype=torch.float64)
        stream.add_(x, stream.std_factor(t))
        out.append(x.numpy())
    return np.array(out)


def _max_over_patterns(c: np.ndarray, b: int, k: int) -> float:
    import itertools

    n = c.shape[1]
    return max(np.linalg.norm(c[:, list(p)].sum(1)) for size in range(1, k + 1)
               for p in itertools.combinations(range(n), size) if all(j - i >= b for i, j in zip(p, p[1:])))


@pytest.mark.parametrize("spec", [CorrelatedMechanism("tree", horizon=8, groups=8),
                                  CorrelatedMechanism("tree", horizon=6, groups=2),
                                  CorrelatedMechanism("bandmf", horizon=7, groups=3, bands=3),
                                  CorrelatedMechanism("bandmf", horizon=6, groups=2, bands=2, amplified=True),
                                  CorrelatedMechanism("blt", horizon=7, groups=2, buffers=2)],
                         ids=lambda spec: spec.describe())
def test_the_json_alone_rebuilds_the_strategy_the_stream_draws_its_noise_from(spec):
    d = _from_json(spec(0))
    c, n, s = _rebuilt_c(d), d["horizon"], d["sensitivity"]
    rng = np.random.default_rng(3)
    draws = list(rng.standard_normal((c.shape[0], 2)))
    got = _released_noise(spec(0), draws)
    if d["kind"] == "tree":  # release t: s (P_t - P_(t-1)), P_t the least-squares prefix estimate from the nodes done
        prefix = [np.zeros(2)]
        for t in range(1, n + 1):
            done = [i for i, (_, last) in enumerate(d["nodes"]) if last <= t]
            ct = c[done][:, :t]
            prefix.append(np.ones(t) @ np.linalg.solve(ct.T @ ct, ct.T @ np.array([draws[i] for i in done])))
        want = s * np.diff(np.array(prefix), axis=0)
    else:
        want = s * np.linalg.solve(c, np.array(draws))
    np.testing.assert_allclose(got, want, rtol=1e-9, atol=1e-12)
    k = 1 if d["amplified"] else d["participations"]
    true = _max_over_patterns(c, d["separation"], k)
    assert s == pytest.approx(true, rel=1e-9) if d["kind"] != "tree" or k == 1 else s >= true - 1e-12
    if d["kind"] == "blt":  # the buffers' decays and weights give the same coefficients
        theta, omega = np.array(d["theta"]), np.array(d["omega"])
        tail = [(omega * theta ** (i - 1)).sum() for i in range(1, n)]
        np.testing.assert_allclose(d["coefficients"], [1.0, *tail], rtol=1e-12)


@pytest.mark.slow
def test_fedprivacy_run_writes_the_noise_mechanism(small_config):
    import json

    cfg = small_config("rounds=2", "privacy.sampling=min_separated", "privacy.groups=2", "privacy.mechanism.kind=tree",
                       "privacy.expected_cohort=6")
    run(cfg)
    written = json.loads((cfg.output_dir / "noise_mechanism.json").read_text())
    assert written["strategy"] == _from_json(CorrelatedMechanism("tree", horizon=2, groups=2)(0))
    assert written["noise_stream"] == "fedprivacy.privacy.correlated:tree(horizon=2, groups=2)"
    assert (written["noise_multiplier"], written["clip_norm"]) == (cfg.privacy.noise_multiplier, cfg.privacy.clip_norm)
