"""Canary clients in `fedprivacy run` (fedprivacy.fl.canaries): counted in the population, sampled, clipped, noised
and accounted like users, their update sent through the client's own pipeline (its noise share, local noise or
SecAgg+ masking) in every placement and mechanism, and the two empirical epsilons in summary.json."""

import json
import math
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.clientapp import ClientApp
from flwr.serverapp import ServerApp
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import given
from hypothesis import strategies as st

from fedprivacy.audit import BROKEN_VARIANTS
from fedprivacy.config import CanaryConfig, ConfigError
from fedprivacy.engines.inprocess import InProcessGrid, run_inprocess
from fedprivacy.fl import mods
from fedprivacy.fl.canaries import CanaryGrid, RunCanaries
from fedprivacy.fl.canary_client import CANARY_RECORD, canary_mod
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.mods import noised_upload
from fedprivacy.fl.records import arrays_to_vector, float32_arrays, model_to_record, record_to_update
from fedprivacy.fl.server_app import DPFedAvgServer
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.accounting import epsilon_for
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.placement import client_noise_std
from fedprivacy.run import run
from fedprivacy.updates import SparseUpdate
from fedprivacy.stackoverflow_tasks import load_task

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
from canary_broken_servers import canary_run, run_overrides  # noqa: E402  (the script's own run)

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


class UnderstatedNoise(GaussianNoise):
    """BROKEN on purpose: a plug-in stream that adds the noise of z/4 while its event accounts z."""

    def std_factor(self, release: int) -> float:
        return 0.25


@pytest.mark.slow
@pytest.mark.parametrize("broken", ["noise_over_cohort", "noise_after_optimizer", "understated_stream"])
def test_a_mechanism_with_too_little_noise_exceeds_the_claim(small_config, broken):
    """Broken servers whose noise falls far below the claim: the audit's that divides the noise by m twice (z/8
    added, z claimed), the one that adds it after the server's step, and a plug-in stream that under-states its noise
    in its event (z/4 added, z accounted): the one-shot interval starts above the claim the run reports. (Milder
    violations, e.g. half the noise, need more canaries or rounds: docs/audit.md, the power table.)"""
    stream = (f"privacy.noise_stream={__name__}:UnderstatedNoise",) if broken == "understated_stream" else ()
    cfg = small_config(*CANARIES, *stream)
    task, out = load_task(cfg.data), {}
    app = ServerApp()
    strategy = DPFedAvg if broken == "understated_stream" else BROKEN_VARIANTS[broken]

    @app.main()
    def main(grid, context):
        out["summary"] = DPFedAvgServer(cfg, task, strategy_cls=strategy).run(grid)

    run_inprocess(app, build_client_app(cfg), task.population + 40)
    e, claim = _estimates(out["summary"])
    assert e["andrew"]["interval"][0] > claim, e["andrew"]


@pytest.mark.slow
@pytest.mark.parametrize("server, caught", [("unclipped", True), ("correct", False)])
def test_a_canary_of_ten_times_the_clip_catches_a_server_that_does_not_clip_each_upload(small_data, tmp_path,
                                                                                       server, caught):
    """privacy.canaries.norm: 10: an included canary uploads 10 C. A correct server clips it to C (the run stays
    within its claim); one that sums the uploads unclipped lets 10 C through, and the one-shot interval starts
    above the claim (40 canaries, 20 rounds: the size at which half the noise passes unseen)."""
    summary, _ = canary_run(server, run_overrides(tmp_path / "run", canaries=40, unused=100, rounds=20, cohort=8,
                                                  norm=10.0), small_data)
    e = summary["empirical_epsilon"]
    assert (e["andrew"]["interval"][0] > e["epsilon_claimed"]) == caught, e["andrew"]


@pytest.mark.parametrize("placement", ["central", "distributed"])
def test_resume_keeps_the_canaries_drawn_from_the_os(small_config, tmp_path, placement):
    """Without a seed the canaries come from the OS; the checkpoint keeps it, so a resumed run ends as a run that
    was given that seed from the start (bit-exact model, equal estimates), also where the canaries' clients add
    their own noise."""
    opts = ("privacy.canaries={count: 8, unused: 10}", "privacy.delta=1e-5", "checkpoint_every=2",
            f"privacy.placement={placement}")
    run(small_config("rounds=2", *opts, f"output_dir={tmp_path / 'part'}"))
    seed = torch.load(tmp_path / "part" / "checkpoint.pt", weights_only=False)["canaries"]["seed"]
    resumed = run(small_config("rounds=4", *opts, f"output_dir={tmp_path / 'part'}"), resume=True)
    full = run(small_config("rounds=4", *opts, "privacy.canaries={count: 8, unused: 10, seed: %d}" % seed,
                            f"output_dir={tmp_path / 'full'}"))
    assert torch.equal(torch.load(tmp_path / "part" / "final_model.pt")["embedding.weight"],
                       torch.load(tmp_path / "full" / "final_model.pt")["embedding.weight"])
    assert resumed["empirical_epsilon"] == full["empirical_epsilon"]


def test_canaries_are_reproducible_from_their_seed_and_clipped_to_c():
    a, b = (RunCanaries(CanaryConfig(count=200, seed=9), users=5, dim=300) for _ in range(2))
    assert (a.included == b.included).all() and 60 < a.included.sum() < 140
    assert torch.equal(a.direction(3), b.direction(3)) and not torch.equal(a.direction(3), a.direction(4))
    i, o = int(np.flatnonzero(a.included)[0]), int(np.flatnonzero(~a.included)[0])
    assert float(a.update(i, 0.7).norm()) == pytest.approx(2.0 * 0.7)  # privacy.canaries.norm: 2 by default
    ten = RunCanaries(CanaryConfig(count=200, seed=9, norm=10.0), users=5, dim=300)
    assert torch.allclose(ten.update(i, 0.7), a.update(i, 0.7) * 5) and not ten.update(o, 0.7).any()
    assert not a.update(o, 0.7).any()
    with pytest.raises(ValueError, match="privacy.canaries.seed=9 differs"):
        a.load_state_dict({"seed": 10})


@pytest.mark.parametrize("placement", ["central", "distributed", "local"])
def test_a_canary_node_sends_its_update_through_the_client_pipeline(small_config, placement):
    """The canaries' nodes are the engine's last ones; their ClientApp replies the canary's update where a user's
    replies its training's, through the same upload: as it is (central), or clipped with the client's own noise
    from the stream (round, partition) of the run seed (distributed, local), exactly."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    cfg, k = small_config(f"privacy.placement={placement}"), 4
    task = load_task(cfg.data)
    model = task.new_model()
    dim = sum(p.numel() for p in model.parameters())
    canaries = RunCanaries(CanaryConfig(count=k, seed=5), users=task.population, dim=dim)
    grid = CanaryGrid(InProcessGrid(build_client_app(cfg), task.population + k), canaries)
    content = RecordDict({"arrays": model_to_record(model), "config": ConfigRecord({"server-round": 3,
                                                                                    "clip-norm": 0.7})})
    nodes = grid.partition_nodes()
    user = Message(content, dst_node_id=nodes[0], message_type="train")
    replies = list(grid.send_and_receive([user] + [Message(content, dst_node_id=n, message_type="train")
                                                   for n in nodes[-k:]]))
    assert CANARY_RECORD not in user.content and CANARY_RECORD not in content  # the broadcast itself is untouched
    assert [r.metadata.src_node_id for r in replies] == [nodes[0], *nodes[-k:]]
    p = cfg.privacy
    std = client_noise_std(placement, p.noise_multiplier, p.clip_norm, p.expected_cohort)
    for i, reply in enumerate(replies[1:]):
        want = canaries.update(i, 0.7)
        if placement != "central":
            want = noised_upload(SparseUpdate.dense(want), p.clip_norm, std,
                                 GaussianNoise(cfg.seed, stream=(3, task.population + i))).values
        assert torch.equal(record_to_update(reply.content["arrays"], dim).to_dense(), want)
        assert dict(reply.content["metrics"]) == ({"num-examples": 0} if placement == "central" else {})
    assert "train_loss" in replies[0].content["metrics"] or placement != "central"


def test_canary_mod_makes_any_client_app_answer_as_a_canary_before_its_noise(small_config, monkeypatch):
    """A ClientApp that replies full weights, with client_noise_mod and canary_mod innermost: a canary's node
    replies x_t + clip(u_i) + its noise share (here from a seeded stream), exactly, without training."""
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = 1, 1, 1
    monkeypatch.setattr(mods, "GaussianNoise", lambda seed, secure: GaussianNoise(7))
    trained = []
    app = ClientApp(mods=[mods.client_noise_mod(placement="distributed", noise_multiplier=1.0, clip_norm=1.0,
                                                expected_cohort=8), canary_mod])

    @app.train()
    def train(msg, context):
        trained.append(msg)
        return Message(RecordDict({"arrays": msg.content["arrays"]}), reply_to=msg)

    model = load_task(small_config().data).new_model()
    dim = sum(p.numel() for p in model.parameters())
    canaries = RunCanaries(CanaryConfig(count=4, seed=5), users=1, dim=dim)
    i = int(np.flatnonzero(canaries.included)[0])
    config = ConfigRecord({"server-round": 1, "clip-norm": 0.7})
    content = RecordDict({"arrays": model_to_record(model), "config": config,
                          CANARY_RECORD: ConfigRecord({"seed": 5, "index": i, "included": True, "norm": 2.0})})
    context = Context(run_id=1, node_id=2, node_config={"partition-id": 0}, state=RecordDict(), run_config={})
    reply = app(Message(content, dst_node_id=2, message_type="train"), context)
    x = arrays_to_vector(float32_arrays(content["arrays"]))
    want = noised_upload(SparseUpdate.dense((x + canaries.update(i, 0.7)) - x), 1.0,
                         client_noise_std("distributed", 1.0, 1.0, 8), GaussianNoise(7)).values
    assert torch.equal(arrays_to_vector(float32_arrays(reply.content["arrays"])), x + want) and not trained
    app(Message(RecordDict({"arrays": content["arrays"], "config": config}), dst_node_id=2, message_type="train"),
        context)
    assert len(trained) == 1  # a user's message reaches the app


SECURE = ("privacy.placement=distributed", "privacy.secure_aggregation={threshold: 3, neighbours: 5}",
          "privacy.accountants=[rdp]", "privacy.budget_accountant=rdp")
BLT = ("privacy.sampling=min_separated", "privacy.groups=2", "privacy.mechanism.kind=blt", "privacy.mechanism.buffers=2")


@pytest.mark.parametrize("options", [("privacy.placement=distributed",), ("privacy.placement=local",), SECURE, BLT,
                                     ("privacy.mechanism.kind=tree", *BLT[:2])],
                         ids=["distributed", "local", "secure-aggregation", "blt", "tree"])
def test_canaries_run_in_every_placement_and_mechanism_below_the_claim(small_config, options):
    """A correct run passes in every placement and mechanism: the estimate's interval starts and the bound lies
    at most at the claim (the canaries' updates went through the clients' noise, the SecAgg+ masking, or the
    correlated stream like a user's)."""
    accountant = "rdp" if options is SECURE else "pld"
    summary = run(small_config(*CANARIES, *options))
    e = summary["empirical_epsilon"]
    assert summary["population"] == 80 and e["epsilon_claimed"] == summary[f"epsilon_{accountant}"] > 0
    assert e["andrew"]["interval"][0] <= e["epsilon_claimed"] and e["steinke"]["epsilon_lower_bound"] <= e["epsilon_claimed"]


def test_large_cohort_emulation_is_tested_against_the_noise_actually_added(small_config):
    """noise_cohort M: the reported epsilon is the emulated deployment's; the canaries' claim is the simulated run's,
    Poisson q = m / N over the run's N = 80 members with noise multiplier z m / M (8 of 16: z/2), here larger."""
    summary = run(small_config(*CANARIES, "privacy.noise_cohort=16"))
    e = summary["empirical_epsilon"]
    assert e["epsilon_claimed"] == epsilon_for("poisson", 8 / 80, 0.5, 20, 1e-5, "pld", population=80)
    assert e["epsilon_reported"] == summary["epsilon_pld"] < e["epsilon_claimed"]
    assert e["andrew"]["interval"][0] <= e["epsilon_claimed"]


@pytest.mark.parametrize("option, message", [
    ("client.sample_dp={noise_multiplier: 1.0}", "privacy.canaries with client.sample_dp: a canary trains on no "),
])
def test_unsupported_runs_are_refused_naming_the_field(small_config, option, message):
    with pytest.raises(ConfigError, match=message):
        small_config("privacy.canaries={count: 8}", option)


@pytest.mark.parametrize("placement", ["distributed", "local"])
def test_a_canary_norm_off_central_placement_is_refused(small_config, placement):
    """privacy.canaries.norm tests the server's per-upload clip; elsewhere the canary's client clips its own upload
    (as a user's does), so a norm other than the default would test nothing: refused, naming the field."""
    with pytest.raises(ConfigError, match=f"privacy.canaries.norm=10.0 tests the server's per-upload clipping.*"
                                          f"under '{placement}'"):
        small_config("privacy.canaries={count: 8, norm: 10}", f"privacy.placement={placement}")
    assert small_config("privacy.canaries={count: 8, norm: 2}", f"privacy.placement={placement}")
    assert small_config("privacy.canaries={count: 8, norm: 10}").privacy.canaries.norm == 10.0


@given(count=st.integers(-3, 10), unused=st.integers(-3, 10), confidence=st.floats(-0.5, 1.5),
       norm=st.one_of(st.floats(-2.0, 20.0), st.sampled_from([math.inf, math.nan])))
def test_canary_section_bounds(count, unused, confidence, norm):
    ok = count >= 4 and unused >= 2 and 0 < confidence < 1 and 1 <= norm < math.inf
    try:
        CanaryConfig(count=count, unused=unused, confidence=confidence, norm=norm)
    except ValueError as err:
        assert not ok, err
    else:
        assert ok
