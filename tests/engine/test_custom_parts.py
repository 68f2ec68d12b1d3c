"""A participation schedule and a server step defined only here run end to end as plug-ins, touching no core file,
the way a noise stream does (tests/engine/test_custom_noise_stream.py): a Poisson schedule whose rate doubles on
every other release, accounted by its own events, and sign-SGD with momentum and a decaying step, through the
mechanism, ``fedprivacy run`` (``privacy.sampling``, ``server.optimizer``), the strategy in a hand-written ServerApp,
the checkpoint and a resume. The built-in names and their object forms run bit for bit alike."""

import json
import math

import dp_accounting
import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from fedprivacy.checkpoints import load_checkpoint
from fedprivacy.config import ConfigError, build_config, plugins
from fedprivacy.fl.server_app import resolve_noise_multiplier
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.optim.fedopt import ServerAdam
from fedprivacy.optim.server_sgd import ServerSGD
from fedprivacy.privacy.accounting import CoveredRelease, GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.correlated import CorrelatedMechanism
from fedprivacy.privacy.mechanism import GaussianMechanism
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.privacy.sampling import FixedSizeSampler, MinSeparatedSampler, PoissonSampler
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

from test_custom_noise_stream import reference_epsilons  # this folder is on sys.path (pytest's rootdir mode)
from test_one_round import run_and_hand_written
from test_strategy import _flat, _plain_client_app, _start


class DoublingRatePoisson:
    """Poisson participation whose expected cohort is ``m`` on odd releases and ``2 m`` on even ones, each
    release accounted as the Poisson-subsampled Gaussian of its own rate."""

    kind = "doubling_rate_poisson"
    separation = None

    def __init__(self, population: int, expected_cohort: int, seed: int, secure: bool, groups: int) -> None:
        if groups != 1 or 2 * expected_cohort > population:
            raise ValueError(f"DoublingRatePoisson needs groups=1 and 2 m <= N, got {groups}, {expected_cohort}")
        self.population, self.expected_cohort = population, expected_cohort
        self._rng = np.random.default_rng(np.random.SeedSequence(None if secure else [seed, 0x2A]))

    def cohort_at(self, release: int) -> int:
        return self.expected_cohort * (2 if release % 2 == 0 else 1)

    def sample(self, release: int) -> np.ndarray:
        return np.flatnonzero(self._rng.random(self.population) < self.cohort_at(release) / self.population)

    def round_event(self, noise_multiplier: float, release: int) -> GaussianRound:
        return GaussianRound(noise_multiplier, "poisson", self.population, float(self.cohort_at(release)))

    def state_dict(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["bit_generator"]


class Halves:
    """Every user every other round: the even users in odd releases, the odd ones in even releases (separation
    2, no sampling), accounted once per cycle of two releases as one unamplified Gaussian."""

    kind = "halves"
    separation = 2

    def __init__(self, population: int, expected_cohort: int, seed: int, secure: bool, groups: int) -> None:
        self.population = population

    def sample(self, release: int) -> np.ndarray:
        return np.arange((release - 1) % 2, self.population, 2)

    def round_event(self, noise_multiplier: float, release: int) -> GaussianRound | CoveredRelease:
        if release % 2 == 0:
            return CoveredRelease(noise_multiplier=noise_multiplier, by="cycle")
        return GaussianRound(noise_multiplier, "none", self.population, float(self.population))

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, state: dict) -> None:
        assert state == {}


class SignumDecay:
    """Sign-SGD with momentum (signum) and step ``lr / sqrt(t)``: ``v <- beta1 v + (1 - beta1) g``,
    ``x <- x + lr / sqrt(t) sign(v)``; records the Phi it is told."""

    def __init__(self, lr: float, beta1: float = 0.0) -> None:
        self.lr, self.beta1 = lr, beta1
        self.velocity: torch.Tensor | None = None
        self.steps = 0
        self.phis: list[float] = []

    def set_phi(self, phi: float) -> None:
        self.phis.append(phi)

    def step_(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        self.steps += 1
        if self.velocity is None:
            self.velocity = torch.zeros_like(params)
        self.velocity.mul_(self.beta1).add_(pseudo_grad, alpha=1 - self.beta1)
        params.add_(torch.sign(self.velocity), alpha=self.lr / math.sqrt(self.steps))

    def state_dict(self) -> dict:
        return {"velocity": self.velocity, "steps": self.steps}

    def load_state_dict(self, state: dict) -> None:
        self.velocity, self.steps = state["velocity"], state["steps"]


SCHEDULE = f"{__name__}:DoublingRatePoisson"
STEP = f"{__name__}:SignumDecay"


def _expected_epsilons(z: float, population: int, m: int, releases: int, delta: float) -> dict[str, float]:
    """The schedule's releases (rate doubled on even ones) through dp_accounting's own accountants."""
    return reference_epsilons([dp_accounting.PoissonSampledDpEvent(
        m * (2 if k % 2 == 0 else 1) / population, dp_accounting.GaussianDpEvent(z)) for k in range(1, releases + 1)],
        delta)


def test_the_mechanism_samples_and_accounts_what_the_schedule_says():
    m = GaussianMechanism(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=10, population=1000, seed=0,
                          sampling=DoublingRatePoisson)
    sizes = {1: [], 2: []}
    for release in range(1, 201):
        sizes[2 - release % 2].append(len(m.sample()))
        m.ledger.compose(m.event())
    assert np.mean(sizes[1]) == pytest.approx(10, rel=0.1) and np.mean(sizes[2]) == pytest.approx(20, rel=0.1)
    assert [e.expected_cohort for e, _ in m.ledger.entries[:4]] == [10.0, 20.0, 10.0, 20.0]
    expected = _expected_epsilons(1.0, 1000, 10, 200, 1e-5)
    got = m.epsilons(1e-5, ["rdp", "pld"])
    assert got["rdp"] == pytest.approx(expected["rdp"], rel=1e-6)
    assert got["pld"] == pytest.approx(expected["pld"], rel=1e-6)
    restored = PrivacyLedger.from_state_dict(json.loads(json.dumps(m.ledger.state_dict())))
    assert restored.entries == m.ledger.entries


def test_a_correlated_stream_refuses_a_schedule_that_bounds_no_participation():
    stream = CorrelatedMechanism(kind="blt", horizon=4, groups=2, bands=1, buffers=1)
    with pytest.raises(ValueError, match=r"needs privacy.sampling: .*got 'doubling_rate_poisson'.* unbounded"):
        GaussianMechanism(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=40, seed=0,
                          sampling=DoublingRatePoisson, noise_stream=stream)


def test_a_correlated_stream_takes_a_schedule_of_ones_own_with_its_separation():
    """The rule asks the schedule's separation, not its name: ``Halves`` is min_separated with b = 2 and m = N / 2."""
    def mechanism(sampling):
        return GaussianMechanism(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=20, population=40, seed=0,
                                 sampling=sampling, groups=2,
                                 noise_stream=CorrelatedMechanism(kind="blt", horizon=6, groups=2, bands=1, buffers=1))
    own, named = mechanism(Halves), mechanism("min_separated")
    assert own.planned_ledger(6).entries == named.planned_ledger(6).entries
    assert all(np.array_equal(own.sampler.sample(k), named.sampler.sample(k)) for k in range(1, 7))


def test_fedprivacy_run_takes_both_parts_from_the_config_and_accounts_the_schedule(small_config):
    cfg = small_config("rounds=4", f"privacy.sampling={SCHEDULE}", f"server.optimizer={STEP}", "server.beta1=0.5",
                       "server.lr=0.01", "privacy.noise_multiplier=1.0")
    summary = run(cfg)
    population, m = load_task(cfg.data).population, cfg.privacy.expected_cohort
    expected = _expected_epsilons(cfg.privacy.noise_multiplier, population, m, 4, summary["delta"])
    assert summary["releases"] == 4
    assert summary["epsilon_pld"] == pytest.approx(expected["pld"], rel=1e-6)
    z = cfg.privacy.noise_multiplier
    events = [GaussianRound(z, "poisson", population, float(c)) for c in (m, 2 * m, m, 2 * m)]
    assert [e["event"] for e in ReleaseLog(cfg.output_dir).entries] == events
    assert summary["epsilon_rdp"] == epsilon(PrivacyLedger([(e, 1) for e in events]), summary["delta"], "rdp")
    saved = load_checkpoint(cfg.output_dir / "checkpoint.pt")
    assert saved["optimizer"]["steps"] == 4 and saved["sampler"]["bit_generator"]["bit_generator"] == "PCG64"


def test_a_hand_written_server_app_with_both_parts_is_bit_identical_to_fedprivacy_run(small_config, tmp_path):
    cfg = small_config("rounds=3", f"output_dir={tmp_path / 'run'}", f"privacy.sampling={SCHEDULE}",
                       f"server.optimizer={STEP}", "server.beta1=0.5", "server.lr=0.01")
    strategy, saved = run_and_hand_written(cfg, sampling=DoublingRatePoisson, optimizer=SignumDecay, lr=0.01, optimizer_settings={"beta1": 0.5})
    assert torch.equal(strategy.params, saved["params"])
    assert strategy.mechanism.ledger.state_dict() == saved["ledger"]
    assert strategy.optimizer.phis == [strategy.mechanism.phi()] * 3  # Phi_t as the release reports it
    assert strategy.settings["sampling"] == SCHEDULE and strategy.settings["optimizer"] == STEP


def test_a_restarted_strategy_continues_both_parts_and_refuses_others(tmp_path):
    settings = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=3, population=8, delta=1e-3, seed=0,
                    sampling=DoublingRatePoisson, optimizer=SignumDecay, lr=0.01, optimizer_settings={"beta1": 0.5})
    full = DPFedAvg(**settings)
    full_result = _start(full, _plain_client_app(), 8, rounds=4, lr=0.5)
    _start(DPFedAvg(**settings, state_dir=tmp_path), _plain_client_app(), 8, rounds=2, lr=0.5)
    restarted = DPFedAvg(**settings, state_dir=tmp_path)
    result = _start(restarted, _plain_client_app(), 8, rounds=4, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(full_result.arrays))
    assert restarted.optimizer.steps == 4 and torch.equal(restarted.optimizer.velocity, full.optimizer.velocity)
    assert restarted.mechanism.ledger.entries == full.mechanism.ledger.entries
    assert [e.expected_cohort for e, _ in restarted.mechanism.ledger.entries] == [3.0, 6.0, 3.0, 6.0]
    with pytest.raises(Exception, match=f"sampling: '{SCHEDULE}' -> 'poisson'"):
        DPFedAvg(**{**settings, "sampling": "poisson"}, state_dir=tmp_path)
    with pytest.raises(Exception, match=f"optimizer: '{STEP}' -> 'sgd'"):
        DPFedAvg(**{**settings, "optimizer": "sgd", "optimizer_settings": {}}, state_dir=tmp_path)


@pytest.mark.parametrize(("name", "factory", "optimizer", "cls", "extra"), [
    ("poisson", PoissonSampler, "sgd", ServerSGD, {"optimizer_settings": {"momentum": 0.9}}),
    ("fixed", FixedSizeSampler, "adam", ServerAdam, {"lr": 0.1}),
    ("min_separated", MinSeparatedSampler, "sgd", ServerSGD, {"groups": 2}),
])
def test_a_built_in_name_and_its_object_form_run_bit_identically(name, factory, optimizer, cls, extra):
    common = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=3, population=8, delta=1e-3, seed=0, **extra)
    by_name = DPFedAvg(sampling=name, optimizer=optimizer, **common)
    by_object = DPFedAvg(sampling=factory, optimizer=cls, **common)
    a = _start(by_name, _plain_client_app(), 8, rounds=3, lr=0.5)
    b = _start(by_object, _plain_client_app(), 8, rounds=3, lr=0.5)
    assert torch.equal(_flat(a.arrays), _flat(b.arrays))
    assert by_name.mechanism.ledger.state_dict() == by_object.mechanism.ledger.state_dict()
    assert by_object.settings["sampling"] == f"fedprivacy.privacy.sampling:{factory.__name__}"


@pytest.mark.parametrize(("overrides", "message"), [
    (["privacy.sampling=no_such_module:Schedule"], "privacy.sampling='no_such_module:Schedule' cannot be imported"),
    (["privacy.sampling=not a spec"], "privacy.sampling"),
    (["server.optimizer=no_such_module:Step"], "server.optimizer='no_such_module:Step' cannot be imported"),
    (["server.optimizer=not a spec"], "server.optimizer"),
    ([f"server.optimizer={STEP}", "server.microadam.density=0.5"], "server.microadam configures"),
    ([f"server.optimizer={STEP}", "server.tau=0.1"], "server optimizer 'SignumDecay' refuses"),
    ([f"privacy.sampling={SCHEDULE}", "privacy.groups=2"], "DoublingRatePoisson needs groups=1"),
])
def test_a_part_that_cannot_be_used_is_refused_naming_the_field(small_config, overrides, message):
    with pytest.raises(ValueError, match=message):
        run(small_config(*overrides))


def test_a_spec_names_the_field_in_the_config_error(small_config):
    with pytest.raises(ConfigError, match=r"server.optimizer.*'adamw'"):
        small_config("server.optimizer=adamw")


BUILT_IN = {"privacy.sampling": ("poisson", "fixed", "cyclic_poisson", "min_separated"),
            "server.optimizer": ("sgd", "adam", "yogi", "adagrad", "adambc", "microadam")}


@given(field=st.sampled_from(sorted(BUILT_IN)),
       value=st.one_of(st.text(max_size=24), st.sampled_from(["a:b", "a.b:c.d", "_m:_f", "a:", ":b", "a::b", "a:b c",
                                                              "1a:b", "a:b:c", "a-b:c", "poisson", "sgd", "adam:"])))
def test_a_value_is_a_built_in_name_a_plugin_spec_or_refused_naming_the_field(field, value):
    section, name = field.split(".")
    try:
        cfg = build_config({section: {name: value}}, [])
    except ConfigError as err:
        assert field in str(err)
        return
    assert value in BUILT_IN[field] or plugins(cfg) == {field: value}
    if value not in BUILT_IN[field]:
        module, _, attribute = value.partition(":")
        assert module and attribute and ":" not in attribute and " " not in value


def test_auto_calibrates_on_the_schedules_own_events(small_config):
    cfg = small_config(f"privacy.sampling={SCHEDULE}", "privacy.noise_multiplier=auto", "privacy.target_epsilon=4",
                       "rounds=10")
    z = resolve_noise_multiplier(cfg, 40).privacy.noise_multiplier
    ledger = PrivacyLedger([(GaussianRound(z, "poisson", 40, float(8 * (2 if k % 2 == 0 else 1))), 1)
                            for k in range(1, 11)])
    assert 0.99 * 4 <= epsilon(ledger, 1 / 40, "rdp") <= 4
    plain = resolve_noise_multiplier(small_config("privacy.noise_multiplier=auto", "privacy.target_epsilon=4",
                                                  "rounds=10"), 40).privacy.noise_multiplier
    assert z > plain  # the even releases sample twice as many: more noise for the same budget
