"""The strategy built from its parts (fedprivacy.fl.parts) is the strategy of the keyword form: the same settings (what
a resume compares, key for key), the same run bit for bit, under central, distributed and secure aggregation, with
correlated noise, record-level events and DiSK; a checkpoint written by either resumes under the other; a wrong or
missing part is refused naming its parameter; each part's settings reach what a resume refuses changed."""

import logging

import pytest
import torch

from fedprivacy.checkpoints import ResumeError
from fedprivacy.fl.aggregation import PlainAggregation, SecureAggregationPart
from fedprivacy.fl.mods import client_noise_mod
from fedprivacy.fl.parts import (Accounting, Bounding, Noise, Participation, ServerStepPart, StrategyParts, merged,
                                 parts_from_keywords)
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.correlated import CorrelatedMechanism
from fedprivacy.fl.secure_aggregation import SecureAggregation
from fedprivacy.privacy.mechanism import AdaptiveClipping

from test_secure_aggregation import SETTINGS, C, N  # this folder is on sys.path (pytest's rootdir mode)
from test_one_round import run_and_hand_written
from test_secure_run import SECAGG as SECURE_RUN
from test_strategy import _flat, _plain_client_app, _reporting, _start

BLT = CorrelatedMechanism(kind="blt", horizon=6, groups=2, buffers=2)
ADAPTIVE = AdaptiveClipping(target_quantile=0.5, learning_rate=0.2, count_stddev=2.0)

CASES = {  # name: (keyword form, parts form, client app)
    "central": (
        dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, delta=1e-3, seed=0,
             optimizer="adam", lr=0.1, optimizer_settings={"tau": 1e-3}, adaptive_clipping=ADAPTIVE,
             target_epsilon=50.0, accountants=("rdp",)),
        dict(participation=Participation(expected_cohort=4, population=8), bounding=Bounding(1.0, ADAPTIVE),
             noise=Noise(1.0, seed=0), server_step=ServerStepPart("adam", 0.1, {"tau": 1e-3}),
             accounting=Accounting(1e-3, 50.0, accountants=("rdp",))),
        _plain_client_app),
    "distributed": (
        dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, sampling="fixed",
             placement="distributed", seed=0, delta=1e-3),
        dict(participation=Participation(4, 8, "fixed"), bounding=Bounding(1.0),
             noise=Noise(1.0, "distributed", seed=0), accounting=Accounting(delta=1e-3)),
        lambda: _plain_client_app(mods=[client_noise_mod(placement="distributed", noise_multiplier=0.0, clip_norm=1.0,
                                                         expected_cohort=4)])),  # the clients clip; no OS noise
    "correlated": (
        dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=2, population=8, delta=1e-3, seed=0,
             sampling="min_separated", groups=2, noise_stream=BLT),
        dict(participation=Participation(2, 8, "min_separated", groups=2), bounding=Bounding(1.0),
             noise=Noise(1.0, stream=BLT, seed=0), accounting=Accounting(delta=1e-3)),
        _plain_client_app),
    "record_level": (
        dict(noise_multiplier=0.5, clip_norm=1.0, expected_cohort=4, population=8, sampling="fixed",
             record_level=True, delta=1e-2, seed=0),
        dict(participation=Participation(4, 8, "fixed"), bounding=Bounding(1.0, record_level=True),
             noise=Noise(0.5, seed=0), accounting=Accounting(delta=1e-2)),
        lambda: _plain_client_app(_reporting())),
    "disk": (
        dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, seed=0, delta=1e-3,
             optimizer="adambc", lr=0.05, disk_kappa=0.7, disk_gamma=0.3),
        dict(participation=Participation(4, 8), bounding=Bounding(1.0), noise=Noise(1.0, seed=0),
             server_step=ServerStepPart("adambc", 0.05, disk_kappa=0.7, disk_gamma=0.3),
             accounting=Accounting(delta=1e-3)),
        _plain_client_app),
}


@pytest.mark.parametrize("case", list(CASES))
def test_the_parts_and_the_keyword_form_have_equal_settings_and_run_bit_identically(case):
    keywords, parts, client_app = CASES[case]
    by_keywords, by_parts = DPFedAvg(**keywords), DPFedAvg(**parts)
    assert by_keywords.settings == by_parts.settings
    a = _start(by_keywords, client_app(), 8, rounds=3, lr=0.5)
    b = _start(by_parts, client_app(), 8, rounds=3, lr=0.5)
    assert torch.equal(_flat(a.arrays), _flat(b.arrays))
    assert by_keywords.mechanism.ledger.state_dict() == by_parts.mechanism.ledger.state_dict()
    assert by_keywords.client_ledgers.state_dict() == by_parts.client_ledgers.state_dict()
    assert by_keywords.epsilons() == by_parts.epsilons() and by_parts.mechanism.ledger.rounds == 3


def test_secure_aggregation_as_a_part_reports_its_parameters_and_the_keyword_forms_settings():
    common = dict(expected_cohort=N, population=N)
    by_keywords = DPFedAvg(noise_multiplier=0.0, clip_norm=C, placement="distributed", secure_aggregation=SETTINGS,
                           seed=0, **common)
    by_parts = DPFedAvg(participation=Participation(**common), bounding=Bounding(C),
                        noise=Noise(0.0, "distributed", seed=0), aggregation=SecureAggregationPart(SETTINGS))
    assert by_keywords.settings == by_parts.settings and by_parts.settings["secure_aggregation"]["threshold"] == 3
    assert by_parts.secure_aggregation == by_keywords.secure_aggregation == SETTINGS
    assert DPFedAvg(**CASES["central"][1]).secure_aggregation is None


def test_a_secure_run_built_from_the_configs_parts_is_bit_identical_to_the_keyword_form(small_config, tmp_path):
    """``fedprivacy run`` builds the parts from the config (fedprivacy.fl.config_parts); the keyword form in a
    hand-written ServerApp against the same seeded clients releases the same model and ledger."""
    cfg = small_config("rounds=2", f"output_dir={tmp_path / 'run'}", *SECURE_RUN)
    strategy, saved = run_and_hand_written(cfg, placement="distributed", optimizer_settings={"momentum": 0.9}, secure_aggregation=SecureAggregation(threshold=3, neighbours=5))
    assert torch.equal(strategy.params, saved["params"])
    assert strategy.mechanism.ledger.state_dict() == saved["ledger"] and strategy.mechanism.ledger.rounds == 2
    assert strategy.settings.items() <= saved["settings"].items()


def test_the_settings_keys_and_values_are_those_saved_checkpoints_hold():
    """The keys and values a checkpoint written before the parts holds (a resume compares them key for key)."""
    assert DPFedAvg(**CASES["central"][0]).settings == {
        "noise_multiplier": 1.0, "clip_norm": 1.0, "expected_cohort": 4, "population": 8, "sampling": "poisson",
        "placement": "central", "optimizer": "adam", "lr": 0.1, "optimizer_settings": {"tau": 1e-3},
        "adaptive_clipping": {"target_quantile": 0.5, "learning_rate": 0.2, "count_stddev": 2.0},
        "disk_kappa": None, "disk_gamma": 0.5, "record_level": False, "delta": 1e-3, "seed": 0, "noise_cohort": None,
        "noise_population": None, "noise_stream": "fedprivacy.privacy.noise:GaussianNoise"}
    assert DPFedAvg(**CASES["correlated"][1]).settings["groups"] == 2


def test_a_checkpoint_of_the_keyword_form_resumes_under_the_parts_form_bit_for_bit(tmp_path):
    keywords, parts, client_app = CASES["central"]
    full = _start(DPFedAvg(**keywords), client_app(), 8, rounds=4, lr=0.5)
    _start(DPFedAvg(**keywords, state_dir=tmp_path), client_app(), 8, rounds=2, lr=0.5)
    resumed = DPFedAvg(**parts, state_dir=tmp_path)
    result = _start(resumed, client_app(), 8, rounds=4, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(full.arrays)) and resumed.mechanism.ledger.rounds == 4


@pytest.mark.parametrize(("part", "changed", "setting"), [
    ("participation", Participation(expected_cohort=3, population=8), "expected_cohort: 4 -> 3"),
    ("bounding", Bounding(2.0, ADAPTIVE), "clip_norm: 1.0 -> 2.0"),
    ("noise", Noise(1.5, seed=0), "noise_multiplier: 1.0 -> 1.5"),
    ("server_step", ServerStepPart("adam", 0.2, {"tau": 1e-3}), "lr: 0.1 -> 0.2"),
    ("accounting", Accounting(1e-4, 50.0, accountants=("rdp",)), "delta: 0.001 -> 0.0001"),
])
def test_a_resume_with_any_parts_setting_changed_is_refused_naming_it(tmp_path, part, changed, setting):
    parts = CASES["central"][1]
    _start(DPFedAvg(**parts, state_dir=tmp_path), _plain_client_app(), 8, rounds=1, lr=0.5)
    with pytest.raises(ResumeError, match=setting):
        DPFedAvg(**{**parts, part: changed}, state_dir=tmp_path)


def test_the_default_noise_part_draws_from_the_os(caplog):
    """``Noise(z)`` without a seed is a deployment's: nothing is logged as a reproducible simulation."""
    with caplog.at_level(logging.WARNING):
        strategy = DPFedAvg(participation=Participation(4, 8), bounding=Bounding(1.0), noise=Noise(1.0))
    assert strategy.settings["seed"] is None and "SIMULATION" not in caplog.text


@pytest.mark.parametrize(("arguments", "message"), [
    ({"participation": Bounding(1.0), "bounding": Bounding(1.0), "noise": Noise(1.0)},
     "participation must be a Participation, got Bounding"),
    ({"participation": Participation(4, 8), "bounding": {"clip_norm": 1.0}, "noise": Noise(1.0)},
     "bounding must be a Bounding, got dict"),
    ({"participation": Participation(4, 8), "bounding": Bounding(1.0), "noise": 1.0}, "noise must be a Noise"),
    ({"participation": Participation(4, 8), "bounding": Bounding(1.0), "noise": Noise(1.0), "server_step": "adam"},
     "server_step must be a ServerStepPart"),
    ({"participation": Participation(4, 8), "bounding": Bounding(1.0), "noise": Noise(1.0), "accounting": 1e-3},
     "accounting must be an? Accounting"),
    ({"participation": Participation(4, 8), "bounding": Bounding(1.0), "noise": Noise(1.0), "aggregation": SETTINGS},
     "aggregation must be an Aggregation .*got SecureAggregation"),
    ({"participation": Participation(4, 8), "noise": Noise(1.0)}, "missing bounding="),
    ({}, "missing participation="),
    ({"participation": Participation(4, 8), "clip_norm": 1.0}, r"give the parts \(participation=...\) or the keyword"),
    ({"noise_multiplier": 1.0, "clip_norm": 1.0, "expected_cohort": 4, "population": 8, "clip": 2.0}, "'clip'"),
])
def test_a_wrong_missing_or_mixed_part_is_refused_naming_the_parameter(arguments, message):
    with pytest.raises(TypeError, match=message):
        DPFedAvg(**arguments)


def test_two_parts_giving_the_same_setting_are_refused_naming_it():
    with pytest.raises(ValueError, match="Noise gives 'clip_norm', which another part gives too"):
        merged([Bounding(1.0), Noise(1.0)], lambda part: {**part.settings(), "clip_norm": 1.0})


def test_the_keyword_form_maps_each_keyword_onto_its_part():
    parts = parts_from_keywords(noise_multiplier=1.0, clip_norm=2.0, expected_cohort=4, population=8, groups=1,
                                lr=0.3, delta=1e-3, noise_stream=BLT, record_level=True)
    assert parts == StrategyParts(Participation(4, 8), Bounding(2.0, record_level=True), Noise(1.0, stream=BLT),
                                  ServerStepPart(lr=0.3), Accounting(delta=1e-3), parts.aggregation)
    assert isinstance(parts.aggregation, PlainAggregation)
    assert isinstance(parts_from_keywords(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=5, population=5,
                                          secure_aggregation=SETTINGS).aggregation, SecureAggregationPart)


def test_the_typed_keyword_form_names_exactly_the_keywords_the_mapping_reads():
    """``DPFedAvg(**keywords)`` is typed by :class:`StrategyKeywords` (so a type checker catches a misspelt or
    mistyped keyword); it must list what :func:`parts_from_keywords` reads, no more and no less."""
    import inspect
    import typing

    from fedprivacy.fl.parts import StrategyKeywords, parts_from_keywords

    read = set(inspect.signature(parts_from_keywords).parameters) - {"aggregation"}
    assert set(typing.get_type_hints(StrategyKeywords)) == read
