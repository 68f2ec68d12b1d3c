"""A deployed client guarantees its own noise: fedprivacy's
ClientApp with ``cfg`` None takes z, m and bits from the SERVER's run config and holds them against the floor
of its own node config (fedprivacy/fl/noise_floor.py); below it, or without it, it refuses with one line."""

import logging
import math
import re

import pytest
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from flwr.supercore.task_identity import TaskIdentity
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from fedprivacy.client.trainer import LocalResult
from fedprivacy.config import PrivacyConfig
from fedprivacy.engines.inprocess import InProcessGrid
from fedprivacy.fl import client_app
from fedprivacy.fl.client_app import build_client_app
from fedprivacy.fl.noise_floor import (BITS_KEY, EXPECTED_COHORT_KEY, IDENTITY_KEY, NEIGHBOURS_KEY, NODE_KEYS,
                                       NOISE_MULTIPLIER_KEY, ROSTER_KEY, THRESHOLD_KEY, NoiseFloor, NoiseFloorError,
                                       SecAggNode, enforce, floor_node_config)
from fedprivacy.fl.records import model_to_record
from fedprivacy.fl.secure_aggregation import SECAGG, SecureAggregation
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.privacy.skellam import MAX_BITS, MIN_BITS, SkellamParams
from fedprivacy.privacy.skellam_accounting import _skellam_rdp
from fedprivacy.stackoverflow_tasks import load_task
from fedprivacy.updates import SparseUpdate

Z, C, M = 0.5, 1.0, 8  # the deployed run's settings (small_config's z, C and m)
FLOOR = {NOISE_MULTIPLIER_KEY: Z, EXPECTED_COHORT_KEY: M, BITS_KEY: 20}
SECAGG_NODE = {THRESHOLD_KEY: 2, NEIGHBOURS_KEY: 3}  # the node's own SecAgg+ t and k


def _zero_update(model, features, labels, **kw) -> LocalResult:  # stands in for local_sgd: Delta_i = 0
    d = sum(p.numel() for p in model.parameters())
    return LocalResult(SparseUpdate.dense(torch.zeros(d)), 0.0, len(labels))


def _node_config(floors):
    """A mod standing in for ``flower-supernode --node-config``: node ``partition-id`` gets ``floors(partition)``."""
    def mod(msg, context, call_next):
        context.node_config.update(floors(int(context.node_config["partition-id"])))
        return call_next(msg, context)
    return mod


def _grid(cfg, floors, nodes=1) -> InProcessGrid:
    """In-process SuperNodes running the DEPLOYED ClientApp (``cfg`` None): ``cfg`` reaches it only as the
    server's run config."""
    grid = InProcessGrid(build_client_app(mods=[_node_config(floors)]), nodes)
    grid.run.override_config = {"config-json": cfg.to_json()}
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, 1
    return grid


def _train(cfg, floor, content=None) -> Message:
    """The deployed client's reply to one ``train`` message of round 1 (a SecAgg+ stage when ``content``)."""
    grid = _grid(cfg, lambda _: floor)
    model = load_task(cfg.data).new_model()
    content = content or RecordDict({"arrays": model_to_record(model),
                                     "config": ConfigRecord({"server-round": 1, "clip-norm": cfg.privacy.clip_norm})})
    msg = Message(content, dst_node_id=2, message_type="train")
    return next(grid.send_and_receive([msg]))


def _upload(reply: Message) -> torch.Tensor:
    assert not reply.has_error(), reply.error.reason
    return torch.from_numpy(reply.content["arrays"]["values"].numpy().copy())


@pytest.fixture
def deployed(small_config, monkeypatch):
    """``deployed(*overrides)``: the server's run config (distributed placement unless overridden)."""
    monkeypatch.setattr(client_app, "local_sgd", _zero_update)
    return lambda *overrides: small_config("privacy.placement=distributed", *overrides)


# -- the ClientApp ----------------------------------------------------------------------------------------------
@pytest.mark.parametrize(("override", "line"), [
    ("privacy.noise_multiplier=0.015625",
     "client refuses the server's noise-multiplier=0.015625: its node config sets noise-multiplier-floor=0.5"),
    ("privacy.expected_cohort=9", "client refuses the server's expected-cohort=9: its node config sets "
                                  "expected-cohort-ceiling=8"),
], ids=["smaller-z", "larger-m"])
def test_a_server_asking_for_less_noise_gets_an_error_reply_naming_the_setting(deployed, override, line):
    reply = _train(deployed(override), FLOOR)
    assert reply.has_error() and reply.error.reason.endswith(line) and "\n" not in reply.error.reason


def test_under_secure_aggregation_fewer_bits_are_refused_at_setup_and_the_floors_bits_accepted(deployed):
    def setup(cfg):
        stage = ConfigRecord({"stage": "setup", "round": 1, "threshold": 2, "neighbours": 3})
        return _train(cfg, {**FLOOR, **SECAGG_NODE}, RecordDict({SECAGG: stage}))

    secure = ("privacy.sampling=poisson", "privacy.budget_accountant=rdp", "privacy.accountants=[rdp]")
    fewer = setup(deployed(*secure, "privacy.secure_aggregation={threshold: 2, neighbours: 3, bits: 19}"))
    assert fewer.has_error() and fewer.error.reason.endswith(
        "client refuses the server's bits=19: its node config sets bits-floor=20")
    same = setup(deployed(*secure, "privacy.secure_aggregation={threshold: 2, neighbours: 3, bits: 20}"))
    assert not same.has_error() and {"pk1", "pk2"} <= set(same.content[SECAGG].keys())


def test_a_deployed_client_holds_secure_aggregation_to_its_own_threshold_not_the_servers_run_config(deployed):
    """The server's run config lowers the threshold to 2 of 3 and announces it: the node config says 3 of 5, so the
    client refuses at setup (a server that picks t and k picks which secrets it can rebuild); without the keys it
    refuses to run the protocol at all."""
    cfg = deployed("privacy.sampling=poisson", "privacy.budget_accountant=rdp", "privacy.accountants=[rdp]",
                   "privacy.secure_aggregation={threshold: 2, neighbours: 3, bits: 20}")
    stage = RecordDict({SECAGG: ConfigRecord({"stage": "setup", "round": 1, "threshold": 2, "neighbours": 3})})
    lowered = _train(cfg, {**FLOOR, THRESHOLD_KEY: 3, NEIGHBOURS_KEY: 5}, stage)
    assert lowered.has_error() and "threshold" in lowered.error.reason and "\n" not in lowered.error.reason
    missing = _train(cfg, FLOOR, stage)
    assert missing.has_error() and missing.error.reason.endswith(
        "set secagg-threshold and secagg-neighbours in its node config (flower-supernode --node-config)")


def test_the_secure_aggregation_node_config_is_read_with_errors_naming_the_key_and_file(tmp_path):
    from fedprivacy.deploy.security import generate_node_keys
    from flwr.supercore.primitives.asymmetric import bytes_to_private_key, public_key_to_bytes

    keys = [generate_node_keys(tmp_path, f"node-{i}") for i in range(3)]
    roster = tmp_path / "roster.pub"
    roster.write_bytes(b"# the deployment's nodes\n\n" + b"".join(k.public_key.read_bytes() for k in keys))
    node = SecAggNode.from_node_config({THRESHOLD_KEY: 3, NEIGHBOURS_KEY: 5, IDENTITY_KEY: str(keys[1].private_key),
                                        ROSTER_KEY: str(roster)})
    own = public_key_to_bytes(bytes_to_private_key(node.identity_key).public_key())
    assert (node.threshold, node.neighbours) == (3, 5) and node.roster is not None and len(node.roster) == 3
    assert own in node.roster
    for bad, words in (({THRESHOLD_KEY: 2, NEIGHBOURS_KEY: 5}, "2 * threshold > neighbours"),
                       ({THRESHOLD_KEY: 3, NEIGHBOURS_KEY: 4}, "must be odd"),
                       ({THRESHOLD_KEY: "3", NEIGHBOURS_KEY: 5}, "secagg-threshold must be an integer"),
                       ({THRESHOLD_KEY: 3}, "set secagg-threshold and secagg-neighbours"),
                       ({THRESHOLD_KEY: 3, NEIGHBOURS_KEY: 5, IDENTITY_KEY: str(tmp_path / "none")},
                        f"secagg-identity-key: cannot read {tmp_path / 'none'}"),
                       ({THRESHOLD_KEY: 3, NEIGHBOURS_KEY: 5, IDENTITY_KEY: str(roster)}, "holds no unencrypted EC"),
                       ({THRESHOLD_KEY: 3, NEIGHBOURS_KEY: 5, ROSTER_KEY: str(keys[0].private_key)}, "line 1 is not"),
                       ({THRESHOLD_KEY: 3, NEIGHBOURS_KEY: 5, ROSTER_KEY: 7}, "must name a file")):
        with pytest.raises(NoiseFloorError, match=re.escape(words)):
            SecAggNode.from_node_config(bad)


@pytest.mark.parametrize("placement", ["distributed", "local"])
def test_without_a_floor_a_deployed_client_refuses_naming_the_node_config_key(deployed, placement):
    reply = _train(deployed(f"privacy.placement={placement}"), {})
    assert reply.has_error() and "refuses to train without a floor: set noise-multiplier-floor in its node config" \
        in reply.error.reason
    partial = _train(deployed(), {NOISE_MULTIPLIER_KEY: Z})  # distributed needs the cohort ceiling too
    assert "set expected-cohort-ceiling in its node config" in partial.error.reason


def test_central_placement_needs_no_floor(deployed):
    assert not _train(deployed("privacy.placement=central"), {}).has_error()


@pytest.mark.parametrize(("overrides", "std"), [
    (("privacy.noise_multiplier=2.0",), 2.0 * C / math.sqrt(M)),  # more noise than the floor: followed
    (("privacy.noise_multiplier=2.0", "privacy.expected_cohort=4"), 2.0 * C / 2),  # fewer shares: larger ones
    (("privacy.clip_norm=0.25",), Z * 0.25 / math.sqrt(M)),  # a smaller C shrinks the clip and the noise alike
    (("privacy.placement=local", "privacy.noise_multiplier=0.75"), 0.75 * C),
], ids=["larger-z", "smaller-m", "smaller-C", "local"])
def test_a_request_at_or_above_the_floor_is_followed_with_the_requested_noise_std(deployed, overrides, std):
    """A zero update: the upload is the share alone; its std over 100,050 coordinates is within 1% of the
    requested one with overwhelming probability (the estimate's relative sd is 1/sqrt(2d) = 0.22%)."""
    upload = _upload(_train(deployed(*overrides), FLOOR))
    assert upload.numel() == 100_050 and float(upload.std()) == pytest.approx(std, rel=0.01)


def test_the_client_clips_at_the_requested_c_it_sizes_its_noise_for(deployed, monkeypatch):
    def spike(model, features, labels, **kw):  # Delta_i = 100 e_0: clipped to C on the wire
        delta = torch.zeros(sum(p.numel() for p in model.parameters()))
        delta[0] = 100.0
        return LocalResult(SparseUpdate.dense(delta), 0.0, len(labels))

    monkeypatch.setattr(client_app, "local_sgd", spike)
    upload = _upload(_train(deployed("privacy.clip_norm=0.25"), FLOOR))
    std = Z * 0.25 / math.sqrt(M)
    assert abs(float(upload[0]) - 0.25) < 6 * std and float(upload[1:].std()) == pytest.approx(std, rel=0.01)


def test_a_strategy_round_drops_the_client_whose_floor_refuses_and_completes_with_the_others(deployed, caplog):
    cfg = deployed()
    strategy = DPFedAvg(noise_multiplier=Z, clip_norm=C, expected_cohort=M, population=M, sampling="fixed",
                        placement="distributed", delta=1e-3)
    grid = _grid(cfg, lambda p: {**FLOOR, NOISE_MULTIPLIER_KEY: 2 * Z} if p == 3 else FLOOR, nodes=M)
    start = model_to_record(load_task(cfg.data).new_model())
    app, out = ServerApp(), {}

    @app.main()
    def main(g: Grid, context: Context) -> None:
        out["result"] = strategy.start(grid=g, initial_arrays=start, num_rounds=1)

    with caplog.at_level(logging.WARNING), grid:
        app(grid, Context(run_id=grid.run.run_id, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    warnings = [r.getMessage() for r in caplog.records]
    assert any("1 update(s) rejected as zero (failed)" in w and "client refuses the server's noise-multiplier=0.5: "
               "its node config sets noise-multiplier-floor=1.0" in w for w in warnings), warnings
    metrics = out["result"].train_metrics_clientapp[1]
    assert (metrics["cohort_accepted"], metrics["rejected_failed"], strategy.mechanism.ledger.rounds) == (M - 1, 1, 1)
    assert metrics["server_noise_std"] == pytest.approx(Z * C * math.sqrt(1 / M))  # the missing share, topped up


def test_a_secure_aggregation_round_completes_without_the_client_whose_bits_floor_refuses(deployed):
    secure = SecureAggregation(threshold=2, neighbours=3, bits=20)
    cfg = deployed("privacy.sampling=poisson", "privacy.budget_accountant=rdp", "privacy.accountants=[rdp]",
                   "privacy.expected_cohort=4", "privacy.secure_aggregation={threshold: 2, neighbours: 3, bits: 20}")
    strategy = DPFedAvg(noise_multiplier=Z, clip_norm=C, expected_cohort=4, population=4, placement="distributed",
                        secure_aggregation=secure, delta=1e-3, accountants=("rdp",), budget_accountant="rdp")
    grid = _grid(cfg, lambda p: {**FLOOR, **SECAGG_NODE, EXPECTED_COHORT_KEY: 4, BITS_KEY: 24 if p == 1 else 20},
                 nodes=4)
    start = model_to_record(load_task(cfg.data).new_model())
    app, out = ServerApp(), {}

    @app.main()
    def main(g: Grid, context: Context) -> None:
        out["result"] = strategy.start(grid=g, initial_arrays=start, num_rounds=1)

    with grid:
        app(grid, Context(run_id=grid.run.run_id, node_id=1, node_config={}, state=RecordDict(), run_config={}))
    metrics = out["result"].train_metrics_clientapp[1]
    assert (metrics["secagg_aborted"], metrics["secagg_survivors"], strategy.mechanism.ledger.rounds) == (0, 3, 1)


# -- the rule ---------------------------------------------------------------------------------------------------
def test_enforce_refuses_each_setting_below_its_floor_and_follows_more_noise(small_config):
    floor = NoiseFloor(1.0, 10, 16)
    secure = ("privacy.placement=distributed", "privacy.sampling=poisson", "privacy.budget_accountant=rdp",
              "privacy.accountants=[rdp]")

    def check(*overrides):
        enforce(floor, small_config(*secure, "privacy.secure_aggregation={threshold: 2, neighbours: 3, bits: 16}",
                                    *overrides).privacy)

    check("privacy.noise_multiplier=1.0", "privacy.expected_cohort=10")  # exactly the floor
    check("privacy.noise_multiplier=3.0", "privacy.expected_cohort=1", "privacy.clip_norm=1e-6",
          "privacy.secure_aggregation.bits=32")
    for overrides, setting in ((("privacy.noise_multiplier=0.999",), "noise-multiplier=0.999"),
                               (("privacy.noise_multiplier=1.0", "privacy.expected_cohort=11"), "expected-cohort=11"),
                               (("privacy.noise_multiplier=1.0", "privacy.secure_aggregation.bits=15"), "bits=15")):
        with pytest.raises(NoiseFloorError, match=f"server's {setting}:"):
            check(*overrides)


def test_a_deployment_writes_its_own_settings_as_each_supernodes_floor(small_config):
    assert floor_node_config(small_config().privacy) == {}
    assert floor_node_config(small_config("privacy.placement=local").privacy) == {NOISE_MULTIPLIER_KEY: Z}
    assert floor_node_config(small_config("privacy.placement=distributed").privacy) == {
        NOISE_MULTIPLIER_KEY: Z, EXPECTED_COHORT_KEY: M}
    auto = small_config("privacy.placement=distributed", "privacy.noise_multiplier=auto", "privacy.target_epsilon=5")
    with pytest.raises(NoiseFloorError, match="needs a given privacy.noise_multiplier"):
        floor_node_config(auto.privacy)
    for placement in ("distributed", "local"):  # what a deployment writes, its own clients accept
        privacy = small_config(f"privacy.placement={placement}").privacy
        enforce(NoiseFloor.from_node_config(floor_node_config(privacy)), privacy)


@settings(max_examples=300, deadline=None)
@given(z_min=st.floats(0.05, 20), m_max=st.integers(1, 200), b_min=st.integers(MIN_BITS, MAX_BITS),
       dz=st.one_of(st.just(1.0), st.floats(0.95, 1.05), st.floats(0.5, 4.0)), dm=st.one_of(st.integers(-2, 2), st.integers(-200, 20)),
       db=st.one_of(st.integers(-1, 1), st.integers(-4, 24)), dim=st.integers(1, 2 ** 22),
       c_floor=st.floats(1e-3, 1e3), c_asked=st.floats(1e-3, 1e3), shares=st.integers(1, 200),
       order=st.sampled_from([2, 3, 8, 32, 256]))
@example(z_min=1.0, m_max=100, b_min=16, dz=1.0, dm=0, db=-1, dim=2 ** 20, c_floor=1.0, c_asked=1.0, shares=100, order=32)
@example(z_min=1.0, m_max=100, b_min=16, dz=1.0, dm=1, db=0, dim=2 ** 20, c_floor=1.0, c_asked=1.0, shares=100, order=32)
@example(z_min=1.0, m_max=100, b_min=16, dz=0.99, dm=0, db=0, dim=2 ** 20, c_floor=1.0, c_asked=1.0, shares=100, order=32)
def test_whatever_the_rule_accepts_keeps_each_share_at_least_as_private_as_the_floors(
        z_min, m_max, b_min, dz, dm, db, dim, c_floor, c_asked, shares, order):
    """What the rule claims (fedprivacy/fl/noise_floor.py): settings :func:`enforce` accepts, with ANY clip norms,
    give a Gaussian share of noise multiplier z / sqrt(m) >= z_min / sqrt(m_max), and a Skellam share whose RDP bound
    (Agarwal et al. Thm. 3.5), at any order and for any number of surviving shares, is at most the floor's at the
    same model dimension."""
    z, m, b = z_min * dz, max(1, m_max + dm), max(MIN_BITS, min(MAX_BITS, b_min + db))
    privacy = PrivacyConfig.model_validate({
        "placement": "distributed", "sampling": "poisson", "budget_accountant": "rdp", "accountants": ["rdp"],
        "noise_multiplier": z, "clip_norm": c_asked, "expected_cohort": m,
        "secure_aggregation": {"threshold": 2, "neighbours": 3, "bits": b}})
    try:
        enforce(NoiseFloor(z_min, m_max, b_min), privacy)
    except NoiseFloorError:
        assert z < z_min or m > m_max or b < b_min  # refused only for a setting below its floor
        return
    assert z / math.sqrt(m) >= z_min / math.sqrt(m_max)
    try:
        floor = SkellamParams(dim=dim, clip_norm=c_floor, noise_multiplier=z_min, expected_cohort=m_max, bits=b_min)
    except ValueError:  # bits too few for the cohort: no floor mechanism to compare with
        return
    asked = SkellamParams(dim=dim, clip_norm=c_asked, noise_multiplier=z, expected_cohort=m, bits=b)

    def rdp(p: SkellamParams) -> float:
        return _skellam_rdp(order, shares * p.share_variance, p.l2_sensitivity, p.l1_sensitivity)

    assert rdp(asked) <= rdp(floor) * (1 + 1e-9)


# -- the node config reader -------------------------------------------------------------------------------------
_NOT_A_NUMBER = st.one_of(st.text(max_size=5), st.booleans(), st.lists(st.integers(), max_size=2),
                          st.just(float("nan")), st.just(float("inf")), st.just(-float("inf")))


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(NODE_KEYS), bad=st.one_of(_NOT_A_NUMBER, st.floats(allow_nan=False, allow_infinity=False)))
def test_a_bad_node_config_value_is_refused_naming_its_key(key, bad):
    integer = key != NOISE_MULTIPLIER_KEY
    valid = {NOISE_MULTIPLIER_KEY: lambda v: v > 0, EXPECTED_COHORT_KEY: lambda v: v >= 1,
             BITS_KEY: lambda v: MIN_BITS <= v <= MAX_BITS}[key]
    assume(isinstance(bad, (str, bool, list)) or not math.isfinite(bad) or integer or not valid(bad))
    with pytest.raises(NoiseFloorError, match=f"^node config {key} must be "):
        NoiseFloor.from_node_config({"partition-id": 0, key: bad})


@settings(max_examples=200, deadline=None)
@given(key=st.sampled_from(NODE_KEYS), value=st.one_of(st.integers(-2 ** 70, 2 ** 70), st.just(10 ** 400)))
def test_integers_are_read_and_out_of_range_ones_refused(key, value):
    valid = {NOISE_MULTIPLIER_KEY: 0 < value < 10 ** 400, EXPECTED_COHORT_KEY: value >= 1,
             BITS_KEY: MIN_BITS <= value <= MAX_BITS}[key]
    if not valid:
        with pytest.raises(NoiseFloorError, match=f"^node config {key} must be "):
            NoiseFloor.from_node_config({key: value})
        return
    floor = NoiseFloor.from_node_config({key: value})
    assert {NOISE_MULTIPLIER_KEY: floor.noise_multiplier, EXPECTED_COHORT_KEY: floor.expected_cohort,
            BITS_KEY: floor.bits}[key] == (float(value) if key == NOISE_MULTIPLIER_KEY else value)


def test_a_valid_node_config_is_read_and_other_keys_ignored():
    floor = NoiseFloor.from_node_config({"partition-id": 3, "num-partitions": 8, **FLOOR})
    assert floor == NoiseFloor(0.5, 8, 20) and NoiseFloor.from_node_config({"partition-id": 3}) == NoiseFloor()
