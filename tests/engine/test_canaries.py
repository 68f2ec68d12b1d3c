"""Canary clients in `fedprivacy run` (fedprivacy.fl.canaries): counted in the population, sampled, clipped, noised
and accounted like users, and the two empirical epsilons in summary.json."""

import json

import numpy as np
import pytest
import torch
from flwr.serverapp import ServerApp
from hypothesis import given
from hypothesis import strategies as st

from fedprivacy.audit import BROKEN_VARIANTS
from fedprivacy.config import CanaryConfig, ConfigError
from fedprivacy.engines.inprocess import run_inprocess
from fedprivacy.fl.canaries import CANARY_NORM, RunCanaries
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.server_app import DPFedAvgServer
from fedprivacy.run import run
from fedprivacy.stackoverflow_tasks import load_task

CANARIES = ("privacy.canaries={count: 40, unused: 100, seed: 3}", "privacy.delta=1e-5", "privacy.noise_multiplier=1.0",
            "privacy.budget_accountant=pld", "rounds=20", "eval_every=20", "checkpoint_every=20")


def _estimates(summary):
    e = summary["empirical_epsilon"]
    return e, summary["epsilon_pld"]


def test_a_run_with_canaries_writes_both_estimates_below_the_claim(small_config):
    cfg = small_config(*CANARIES)
    summary = run(cfg)
    e, claim = _estimates(summary)
    assert summary["population"] == 40 + 40  # the users and the canaries
    assert e["epsilon_claimed"] == claim and e["delta"] == 1e-5 and e["canaries"] == 40
    assert e["andrew"]["inserted"] == e["included"] and e["andrew"]["unobserved"] == 40 - e["included"] + 100
    assert e["andrew"]["interval"][0] <= claim
    assert e["steinke"]["epsilon_lower_bound"] <= claim and e["steinke"]["guesses"] == 20
    assert json.loads((cfg.output_dir / "summary.json").read_text())["empirical_epsilon"]["andrew"] == e["andrew"]


def test_a_mechanism_with_too_little_noise_exceeds_the_claim(small_config):
    """The audit's broken server that divides the noise by m twice: the run claims z = 1 and adds z / 8."""
    cfg = small_config(*CANARIES)
    task, out = load_task(cfg.data), {}
    app = ServerApp()

    @app.main()
    def main(grid, context):
        out["summary"] = DPFedAvgServer(cfg, task, strategy_cls=BROKEN_VARIANTS["noise_over_cohort"]).run(grid)

    run_inprocess(app, build_client_app(cfg), task.population)
    e, claim = _estimates(out["summary"])
    assert e["andrew"]["interval"][0] > claim
    assert e["steinke"]["correct"] == e["steinke"]["guesses"]  # every guess right (20 guesses bound at most ~1.8)


def test_resume_keeps_the_canaries_drawn_from_the_os(small_config, tmp_path):
    """Without a seed the canaries come from the OS; the checkpoint keeps it, so a resumed run ends as a run that
    was given that seed from the start (bit-exact model, equal estimates)."""
    opts = ("privacy.canaries={count: 8, unused: 10}", "privacy.delta=1e-5", "checkpoint_every=2")
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'part'}"))
    seed = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)["canaries"]["seed"]
    resumed = run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'part'}"), resume=True)
    full = run(small_config("rounds=4", "privacy.canaries={count: 8, unused: 10, seed: %d}" % seed,
                            "privacy.delta=1e-5", "checkpoint_every=2", f"output_dir={tmp_path / 'full'}"))
    assert torch.equal(torch.load(tmp_path / "part" / "final_model.pt")["embedding.weight"],
                       torch.load(tmp_path / "full" / "final_model.pt")["embedding.weight"])
    assert resumed["empirical_epsilon"] == full["empirical_epsilon"]


def test_canaries_are_reproducible_from_their_seed_and_clipped_to_c():
    a, b = (RunCanaries(CanaryConfig(count=200, seed=9), users=5, dim=300) for _ in range(2))
    assert (a.included == b.included).all() and 60 < a.included.sum() < 140
    assert torch.equal(a.direction(3), b.direction(3)) and not torch.equal(a.direction(3), a.direction(4))
    i, o = int(np.flatnonzero(a.included)[0]), int(np.flatnonzero(~a.included)[0])
    assert float(a.update(i, 0.7).norm()) == pytest.approx(CANARY_NORM * 0.7) and CANARY_NORM > 1
    assert not a.update(o, 0.7).any()
    with pytest.raises(ValueError, match="privacy.canaries.seed=9 differs"):
        a.load_state_dict({"seed": 10})


@pytest.mark.parametrize("option, field", [
    ("privacy.placement=distributed", "privacy.placement"),
    ("privacy.mechanism={kind: tree}", "privacy.mechanism.kind"),
    ("privacy.noise_cohort=100", "privacy.noise_cohort"),
    ("engine=ray", "engine"),
])
def test_unsupported_runs_are_refused_naming_the_field(small_config, option, field):
    extra = ("privacy.sampling=min_separated", "privacy.groups=2") if "tree" in option else ()
    with pytest.raises(ConfigError, match=f"privacy.canaries needs .*{field}="):
        small_config("privacy.canaries={count: 8}", option, *extra)


@given(count=st.integers(-3, 10), unused=st.integers(-3, 10), confidence=st.floats(-0.5, 1.5))
def test_canary_section_bounds(count, unused, confidence):
    ok = count >= 4 and unused >= 2 and 0 < confidence < 1
    try:
        CanaryConfig(count=count, unused=unused, confidence=confidence)
    except ValueError as err:
        assert not ok, err
    else:
        assert ok
