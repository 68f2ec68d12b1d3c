"""An aggregation part defined only here runs through ``DPFedAvg(aggregation=...)`` in a hand-written ServerApp on the
in-process engine, touching no core file (as a schedule or a server step does: test_custom_parts.py): a
coordinate-clipped sum that clamps each coordinate of each update to ``[-b, b]`` before the mechanism's clip to C,
so a contribution still has norm at most C and the release is accounted exactly as the plain one. The built-in
parts' object forms run bit for bit as the keyword forms."""

import pytest
import torch
from flwr.app import ArrayRecord

from fedprivacy.checkpoints import ResumeError, load_checkpoint
from fedprivacy.config import ConfigError, check_plugins
from fedprivacy.fl.aggregation import (Abort, Aggregation, PlainAggregation, Released, SecureAggregationPart,
                                       aggregation_of)
from fedprivacy.privacy.combination import Combination
from fedprivacy.fl.secure_aggregation import SecureAggregation
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.optim.broadcast import StepBroadcast
from fedprivacy.run import run
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.updates import SparseUpdate

from test_one_round import run_and_hand_written
from test_strategy import _flat, _model, _plain_client_app, _start  # this folder is on sys.path (rootdir mode)


class _Clamping:
    """``agg`` seen through a coordinate clamp: each update's values clamped to ``[-bound, bound]`` before its clip."""

    def __init__(self, agg: PrivateSum, bound: float) -> None:
        self.agg, self.bound = agg, bound

    def reject(self, reason: str, source: object = "?", detail: str = "") -> None:
        self.agg.reject(reason, source, detail)

    def add_(self, update: SparseUpdate, source: object = "?") -> bool:
        clamped = SparseUpdate(update.indices, update.values.clamp(-self.bound, self.bound), update.dim)
        return self.agg.add_(clamped, source)


class CoordinateClipped:
    """Clamp every coordinate to ``[-bound, bound]``, then the plain clip-and-sum and the mechanism's release."""

    def __init__(self, bound: float) -> None:
        self.bound = bound
        self.rounds: list[int] = []

    def settings(self):
        return {"aggregation": f"{__name__}:CoordinateClipped", "coordinate_bound": self.bound}

    def refusal(self, combination):
        return "CoordinateClipped: DiSK's combined update is not clamped coordinate-wise" if combination.disk else None

    def mechanism(self, mechanism_cls, args):
        return mechanism_cls(**args)

    def adopt(self, mechanism, dim):
        self.dim = dim

    def messages_for(self, strategy, grid, t, cohort, content):
        return [(node, content) for node in cohort]

    def release(self, strategy, t, replies):
        self.rounds.append(t)
        agg = strategy.aggregator()
        diagnostics = strategy.collect(t, replies, _Clamping(agg, self.bound))  # type: ignore[arg-type]
        strategy.report_rejections(agg)
        return Released(agg, strategy.mechanism.release(agg, t), diagnostics, {"coordinate_bound": self.bound})


def clamping_at_a_hundredth() -> CoordinateClipped:
    """The plug-in factory ``privacy.aggregation`` names (called with no arguments)."""
    return CoordinateClipped(0.01)


AGGREGATION = f"{__name__}:clamping_at_a_hundredth"
COMMON = dict(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=4, population=8, delta=1e-3, seed=0)


def test_the_part_implements_the_protocol():
    part: Aggregation = CoordinateClipped(0.01)  # mypy checks the structural match
    assert part.refusal(Combination(record_level=True, disk=False, noise_stream="gaussian", independent_noise=True)) \
        is None


def test_a_bound_that_clamps_nothing_runs_bit_for_bit_as_the_plain_aggregation():
    plain, own = DPFedAvg(**COMMON), DPFedAvg(**COMMON, aggregation=CoordinateClipped(1e9))
    a = _start(plain, _plain_client_app(), 8, rounds=3, lr=0.5)
    b = _start(own, _plain_client_app(), 8, rounds=3, lr=0.5)
    assert torch.equal(_flat(a.arrays), _flat(b.arrays))
    assert plain.mechanism.ledger.entries == own.mechanism.ledger.entries and own.mechanism.ledger.rounds == 3
    assert own.aggregation.rounds == [1, 2, 3] and own.aggregation.dim == 200 * 100 + 100  # told the model's size
    assert b.train_metrics_clientapp[3]["coordinate_bound"] == 1e9  # the part's own metrics reach the round's


def test_a_clamping_bound_moves_each_coordinate_by_at_most_the_bound_and_is_accounted_as_plain():
    """Without noise, ``x_1 - x_0 = sum_i clip(clamp(u_i)) / m``: at most ``|S_1| b / m`` per coordinate, and the same
    ``sum`` as the clients' clamped updates summed here; the ledger is the plain mechanism's."""
    bound, settings = 1e-3, {**COMMON, "noise_multiplier": 0.0, "clip_norm": 1e9}
    clamped, plain = DPFedAvg(**settings, aggregation=CoordinateClipped(bound)), DPFedAvg(**settings)
    a = _start(clamped, _plain_client_app(), 8, rounds=1, lr=0.5)
    b = _start(plain, _plain_client_app(), 8, rounds=1, lr=0.5)
    x0 = _flat(ArrayRecord(_model().state_dict()))
    moved, unclamped = _flat(a.arrays) - x0, _flat(b.arrays) - x0
    cohort = len(clamped.cohort)
    assert cohort == len(plain.cohort) and cohort > 0  # the same seeded cohort
    assert float(unclamped.abs().max()) > cohort * bound / 4  # clamping changes something
    assert float(moved.abs().max()) <= cohort * bound / 4 + 1e-7  # + float32 rounding of x_0 + g - x_0
    assert clamped.mechanism.ledger.entries == plain.mechanism.ledger.entries


def test_the_part_adds_its_settings_and_a_resume_with_another_is_refused(tmp_path):
    DPFedAvg(**COMMON, aggregation=CoordinateClipped(0.5), state_dir=tmp_path)
    strategy = DPFedAvg(**COMMON, aggregation=CoordinateClipped(0.5))
    assert strategy.settings["coordinate_bound"] == 0.5
    _start(DPFedAvg(**COMMON, aggregation=CoordinateClipped(0.5), state_dir=tmp_path), _plain_client_app(), 8,
           rounds=1, lr=0.5)
    with pytest.raises(ResumeError, match=r"coordinate_bound: 0.5 -> 0.25"):
        DPFedAvg(**COMMON, aggregation=CoordinateClipped(0.25), state_dir=tmp_path)
    with pytest.raises(ResumeError, match=r"aggregation: '.*CoordinateClipped' -> None"):
        DPFedAvg(**COMMON, state_dir=tmp_path)


def test_a_part_refuses_what_it_cannot_combine_with_through_its_refusal():
    with pytest.raises(ValueError, match="CoordinateClipped: DiSK's combined update"):
        DPFedAvg(**COMMON, aggregation=CoordinateClipped(0.5), disk_kappa=0.7)
    with pytest.raises(ValueError, match="secure_aggregation: record_level and disk_kappa are not supported"):
        DPFedAvg(**{**COMMON, "placement": "distributed"}, record_level=True,
                 aggregation=SecureAggregationPart(SecureAggregation(threshold=3, neighbours=5)))


def test_the_keyword_and_object_forms_are_the_same_part_with_the_same_settings():
    secagg = SecureAggregation(threshold=3, neighbours=5)
    settings = {**COMMON, "placement": "distributed", "accountants": ("rdp",)}
    by_keyword = DPFedAvg(**settings, secure_aggregation=secagg)
    by_object = DPFedAvg(**settings, aggregation=SecureAggregationPart(secagg))
    assert by_keyword.settings == by_object.settings and "secure_aggregation" in by_object.settings
    assert type(by_keyword.mechanism) is type(by_object.mechanism)
    assert isinstance(DPFedAvg(**COMMON).aggregation, PlainAggregation)
    assert DPFedAvg(**COMMON).settings == DPFedAvg(**COMMON, aggregation=PlainAggregation()).settings
    with pytest.raises(ValueError, match="not both"):
        aggregation_of(SecureAggregationPart(secagg), secagg)


def test_a_part_that_aborts_leaves_the_model_and_the_ledger_as_they_were():
    """An :class:`~fedprivacy.fl.aggregation.Abort` releases nothing: the model is the broadcast one, nothing is
    accounted, and the round's metrics are the part's with the epsilons so far."""
    class Refusing(CoordinateClipped):
        def release(self, strategy, t, replies):
            list(replies)
            return Abort({"refused": 1.0})

    strategy = DPFedAvg(**COMMON, aggregation=Refusing(0.5))
    result = _start(strategy, _plain_client_app(), 8, rounds=2, lr=0.5)
    assert torch.equal(_flat(result.arrays), _flat(ArrayRecord(_model().state_dict())))
    assert strategy.mechanism.ledger.rounds == 0 and result.train_metrics_clientapp[2]["refused"] == 1.0


class NoiseAwareStep:
    """A server step that needs Phi_t and sends something to the clients: ``x <- x + lr / (1 + Phi_t) g``, and from
    round 2 the model before its last step (record ``anchor``) and that step's scale (config ``step-scale``)."""

    def __init__(self, lr: float) -> None:
        self.lr, self.phi, self.previous = lr, None, None

    def set_phi(self, phi: float) -> None:
        self.phi = phi

    def step_(self, params, pseudo_grad) -> None:
        self.previous = params.clone()
        params.add_(pseudo_grad, alpha=self.lr / (1 + self.phi))

    def broadcast(self, params) -> StepBroadcast:
        if self.previous is None:
            return StepBroadcast()
        return StepBroadcast({"anchor": self.previous}, {"step-scale": self.lr / (1 + self.phi)})

    def state_dict(self) -> dict:
        return {"previous": self.previous, "phi": self.phi}

    def load_state_dict(self, state: dict) -> None:
        self.previous, self.phi = state["previous"], state["phi"]


def _spy(seen: list):
    """A client mod recording each train message's round, model, anchor and step scale (or None)."""
    def mod(msg, context, call_next):
        anchor = msg.content.array_records.get("anchor")
        seen.append((msg.content["config"]["server-round"], _flat(msg.content["arrays"]),
                     None if anchor is None else _flat(anchor), msg.content["config"].get("step-scale")))
        return call_next(msg, context)
    return mod


def test_a_server_step_of_ones_own_gets_phi_and_adds_to_the_broadcast_through_one_hook():
    """Told Phi_t, its steps are SGD's at ``lr / (1 + Phi)`` bit for bit; from round 2 every sampled client receives
    the previous model and the scale, and the downlink counts the extra array."""
    seen: list = []
    own = DPFedAvg(**COMMON, optimizer=NoiseAwareStep, lr=0.5)
    phi = own.mechanism.phi()
    result = _start(own, _plain_client_app(mods=[_spy(seen)]), 8, rounds=3, lr=0.5)
    sgd = DPFedAvg(**COMMON, optimizer="sgd", lr=0.5 / (1 + phi))
    assert phi > 0 and torch.equal(_flat(result.arrays), _flat(_start(sgd, _plain_client_app(), 8, 3, 0.5).arrays))
    models = {t: model for t, model, _, _ in seen}
    assert all(anchor is None and scale is None for t, _, anchor, scale in seen if t == 1)
    later = [(t, anchor, scale) for t, _, anchor, scale in seen if t > 1]
    assert later and all(torch.equal(anchor, models[t - 1]) and scale == 0.5 / (1 + phi) for t, anchor, scale in later)
    dim = models[1].numel()
    assert [result.train_metrics_clientapp[t]["downlink_bytes_per_client"] for t in (1, 2, 3)] == [4 * dim,
                                                                                                    8 * dim, 8 * dim]


def test_a_step_that_would_overwrite_the_model_in_the_broadcast_is_refused():
    class Overwriting(NoiseAwareStep):
        def broadcast(self, params) -> StepBroadcast:
            return StepBroadcast({"arrays": params})

    with pytest.raises(ValueError, match="adds 'arrays' to the broadcast"):
        _start(DPFedAvg(**COMMON, optimizer=Overwriting, lr=0.5), _plain_client_app(), 8, rounds=1, lr=0.5)


def test_two_parts_of_the_step_sending_the_same_name_are_refused_naming_it():
    class Lookahead(NoiseAwareStep):
        def broadcast(self, params) -> StepBroadcast:
            return StepBroadcast({"lookahead": params})

    with pytest.raises(ValueError, match="Lookahead adds 'lookahead' to the broadcast, which another part"):
        _start(DPFedAvg(**COMMON, optimizer=Lookahead, lr=0.5, disk_kappa=0.5), _plain_client_app(), 8, rounds=2,
               lr=0.5)


def test_fedprivacy_run_takes_the_part_from_the_config_bit_identically_to_a_hand_written_server_app(small_config,
                                                                                                    tmp_path):
    """``privacy.aggregation: module:factory`` through ``fedprivacy run`` releases what ``DPFedAvg(aggregation=...)``
    releases in a hand-written ServerApp against the same seeded clients, and saves the part's settings."""
    cfg = small_config("rounds=3", f"output_dir={tmp_path / 'run'}", f"privacy.aggregation={AGGREGATION}")
    strategy, saved = run_and_hand_written(cfg, optimizer_settings={"momentum": 0.9}, aggregation=CoordinateClipped(0.01))
    assert torch.equal(strategy.params, saved["params"]) and strategy.aggregation.rounds == [1, 2, 3]
    assert strategy.mechanism.ledger.state_dict() == saved["ledger"]
    assert saved["settings"]["coordinate_bound"] == 0.01 and strategy.settings.items() <= saved["settings"].items()
    unclamped = small_config("rounds=1", f"output_dir={tmp_path / 'plain'}")
    run(unclamped)
    assert not torch.equal(load_checkpoint(tmp_path / "plain" / "checkpoint.pt")["params"],
                           load_checkpoint(tmp_path / "run" / "checkpoint.pt")["params"])


def test_the_aggregation_plug_in_is_refused_without_the_opt_in_and_with_what_it_cannot_run_with(small_config):
    cfg = small_config(f"privacy.aggregation={AGGREGATION}")
    with pytest.raises(ConfigError, match=r"privacy.aggregation=.*names a plug-in.*--allow-plugins"):
        check_plugins(cfg, allowed=False)
    check_plugins(cfg, allowed=True)
    with pytest.raises(ValueError, match="privacy.aggregation=.* no privacy.secure_aggregation"):
        small_config(f"privacy.aggregation={AGGREGATION}", "privacy.placement=distributed",
                     "privacy.secure_aggregation.threshold=3", "privacy.secure_aggregation.neighbours=5",
                     "privacy.accountants=[rdp]")
    with pytest.raises(ValueError, match="privacy.aggregation=.* needs a given privacy.noise_multiplier"):
        small_config(f"privacy.aggregation={AGGREGATION}", "privacy.noise_multiplier=auto", "privacy.target_epsilon=4")
    with pytest.raises(ValueError, match="privacy.aggregation='no_such_module:Sum' cannot be imported"):
        run(small_config("privacy.aggregation=no_such_module:Sum"))
