"""A noise mechanism defined only here runs end to end through the mechanism's seams, touching no core file
(issue "One round, one orchestrator", item 3): a noise stream whose std doubles on every other release, with
its own accounted event type, through the mechanism, ``fedprivacy run`` (``privacy.noise_stream``), the
strategy in a hand-written ServerApp, the release log and a resume."""

import csv
import json
from dataclasses import dataclass

import dp_accounting
import pytest
import torch
from dp_accounting import pld, rdp
from opacus.accountants import RDPAccountant

from fedprivacy.checkpoints import load_checkpoint
from fedprivacy.config import ConfigError
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.events import register_event
from fedprivacy.privacy.mechanism import GaussianMechanism
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

from test_one_round import run_and_hand_written  # this folder is on sys.path (pytest's rootdir mode)

from test_strategy import _flat, _plain_client_app, _start


@register_event
@dataclass(frozen=True)
class AlternatingRound:
    """One release of a Poisson-subsampled Gaussian with this release's own noise multiplier."""

    noise_multiplier: float
    sampling_probability: float

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

    def dp_event(self) -> dp_accounting.DpEvent:
        return dp_accounting.PoissonSampledDpEvent(self.sampling_probability,
                                                   dp_accounting.GaussianDpEvent(self.noise_multiplier))


class DoublingNoise(GaussianNoise):
    """Independent Gaussian noise whose std is ``2 z C`` on even releases and ``z C`` on odd ones."""

    def std_factor(self, release: int) -> float:
        return 2.0 if release % 2 == 0 else 1.0

    def event(self, sampled: GaussianRound, release: int) -> AlternatingRound:
        return AlternatingRound(sampled.noise_multiplier * self.std_factor(release), sampled.q)


SPEC = f"{__name__}:DoublingNoise"


def reference_epsilons(events: list[dp_accounting.DpEvent], delta: float) -> dict[str, float]:
    """dp_accounting's own RDP (Opacus' orders) and PLD accountants on ``events``, composed in order."""
    rdp_accountant = rdp.RdpAccountant(RDPAccountant.DEFAULT_ALPHAS)
    pld_accountant = pld.PLDAccountant(value_discretization_interval=1e-3)
    for e in events:
        rdp_accountant.compose(e)
        pld_accountant.compose(e)
    return {"rdp": rdp_accountant.get_epsilon(delta), "pld": pld_accountant.get_epsilon(delta)}


def _expected_epsilons(z: float, q: float, releases: int, delta: float) -> dict[str, float]:
    """The releases' DpEvents (z doubled on even releases) through :func:`reference_epsilons`."""
    return reference_epsilons([dp_accounting.PoissonSampledDpEvent(
        q, dp_accounting.GaussianDpEvent(z * (2.0 if k % 2 == 0 else 1.0))) for k in range(1, releases + 1)], delta)


def test_the_mechanism_draws_phi_and_accounts_what_the_stream_says():
    m = GaussianMechanism(noise_multiplier=1.0, clip_norm=0.5, expected_cohort=10, population=100, seed=0,
                          noise_stream=DoublingNoise)
    for release in (1, 2, 3, 4):
        factor = 2.0 if release % 2 == 0 else 1.0
        out = m.release(m.aggregator(200_000), release)  # no updates: the released value is the noise / m
        assert float((out.g * 10).std()) == pytest.approx(factor * 0.5, rel=0.01)
        assert out.phi == pytest.approx((factor * 0.5 / 10) ** 2, rel=1e-12)
    assert [(e.noise_multiplier, n) for e, n in m.ledger.entries] == [(1.0, 1), (2.0, 1), (1.0, 1), (2.0, 1)]
    expected = _expected_epsilons(1.0, 0.1, 4, 1e-5)
    got = m.epsilons(1e-5, ["rdp", "pld"])
    assert got["rdp"] == pytest.approx(expected["rdp"], rel=1e-6)
    assert got["pld"] == pytest.approx(expected["pld"], rel=1e-6)
    plain = [epsilon(PrivacyLedger([(GaussianRound(z, "poisson", 100, 10.0), 4)]), 1e-5, "pld") for z in (2.0, 1.0)]
    assert plain[0] < got["pld"] < plain[1]  # between four releases at 2z and four at z
    restored = PrivacyLedger.from_state_dict(json.loads(json.dumps(m.ledger.state_dict())))
    assert restored.entries == m.ledger.entries


def test_fedprivacy_run_takes_the_stream_from_the_config_and_reports_its_epsilon(small_config, tmp_path):
    cfg = small_config("rounds=4", f"privacy.noise_stream={SPEC}")
    summary = run(cfg)
    q = cfg.privacy.expected_cohort / load_task(cfg.data).population
    expected = _expected_epsilons(cfg.privacy.noise_multiplier, q, 4, summary["delta"])
    assert summary["releases"] == 4
    assert summary["epsilon_rdp"] == pytest.approx(expected["rdp"], rel=1e-6)
    with open(cfg.output_dir / "metrics.csv") as f:
        stds = [float(row["server_noise_std"]) for row in csv.DictReader(f)]
    zc = cfg.privacy.noise_multiplier * cfg.privacy.clip_norm
    assert stds == pytest.approx([zc, 2 * zc, zc, 2 * zc])
    logged = [e["event"] for e in ReleaseLog(cfg.output_dir).entries]
    assert logged == [AlternatingRound(cfg.privacy.noise_multiplier * f, q) for f in (1.0, 2.0, 1.0, 2.0)]
    assert load_checkpoint(cfg.output_dir / "checkpoint.pt")["ledger"]["entries"][1]["type"] == "AlternatingRound"


def test_a_hand_written_server_app_with_the_stream_is_bit_identical_to_fedprivacy_run(small_config, tmp_path):
    cfg = small_config("rounds=3", f"output_dir={tmp_path / 'run'}", f"privacy.noise_stream={SPEC}")
    strategy, saved = run_and_hand_written(cfg, optimizer_settings={"momentum": 0.9}, noise_stream=DoublingNoise)
    assert torch.equal(strategy.params, saved["params"])
    assert strategy.mechanism.ledger.state_dict() == saved["ledger"]


def test_a_restarted_strategy_continues_the_stream_and_refuses_another(tmp_path):
    settings = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, delta=1e-3, seed=0,
                    noise_stream=DoublingNoise)
    full = _start(DPFedAvg(**settings), _plain_client_app(), 8, rounds=4, lr=0.5)
    _start(DPFedAvg(**settings, state_dir=tmp_path), _plain_client_app(), 8, rounds=2, lr=0.5)
    restarted = DPFedAvg(**settings, state_dir=tmp_path)
    result = _start(restarted, _plain_client_app(), 8, rounds=4, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(full.arrays))
    assert [e.noise_multiplier for e, _ in restarted.mechanism.ledger.entries] == [1.0, 2.0, 1.0, 2.0]
    with pytest.raises(Exception, match="noise_stream: .*DoublingNoise' -> .*GaussianNoise'"):
        DPFedAvg(**{**settings, "noise_stream": GaussianNoise}, state_dir=tmp_path)


@pytest.mark.parametrize(("override", "message"), [
    ("privacy.noise_stream=no_such_module:Stream", "privacy.noise_stream='no_such_module:Stream' cannot be imported"),
    ("privacy.noise_stream=not a spec", "noise_stream"),
    ("privacy.placement=distributed", "privacy.noise_stream=.*needs .*placement: central"),
])
def test_a_stream_that_cannot_be_used_is_refused_naming_the_field(small_config, override, message):
    with pytest.raises(ConfigError, match=message):
        cfg = small_config(f"privacy.noise_stream={SPEC}", override)
        run(cfg)
