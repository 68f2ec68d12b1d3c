r"""``fedprivacy audit``: an empirical lower bound on the epsilon of one DP-FedAvg round.

**What is claimed.** One round of the configured mechanism releases
:math:`g = \frac1m\big(\sum_{i\in S}\operatorname{clip}(u_i, C) + \mathcal N(0, z^2C^2 f_1^2 I)\big)` and the
server optimizer post-processes it (:math:`f_1`: the noise stream's std factor of its first release, 1 for
independent noise). The canary is always in the cohort, so the round is accounted WITHOUT sampling
amplification. The claim is the smaller of two epsilons at ``delta`` (the project's accountant, PLD by default):

- **what the run reports**: the epsilon of the event the round's own ledger composed, as ``fedprivacy run``
  composes it (the noise stream's ``event`` for an unamplified Gaussian of the run's ``z``). A stream whose
  event claims more noise than it adds (a plug-in that adds noise for ``z/4`` but accounts ``z``) is judged
  against what it reports, and fails;
- **what the first release's noise is**: a Gaussian mechanism with sensitivity :math:`C/m` and noise
  :math:`zCf_1/m`, exactly :math:`\mu`-GDP with :math:`\mu = 1/(zf_1)` (Dong, Roth, Su 2019,
  arXiv:1905.02383, Thm. 2.7). For correlated noise the ledger's event covers the whole horizon, so this
  one-release claim is the tighter one and keeps the audit's power.

A correct mechanism meets both, so taking the smaller keeps the false-alarm rate at ``alpha``.

**What is measured.** Each trial runs the REAL round (the :class:`~fedprivacy.fl.strategy.DPFedAvg`
strategy's, as ``fedprivacy run`` drives it: its aggregation, noise and server optimizer, through the
in-process Flower grid) from a fresh state
on a cohort the audit chooses (the claim must hold for every cohort), in pairs: the same cohort
with the canary ("in") and without it ("out", add/remove neighbours), with independent noise.
The score is the released model change projected on the canary's direction :math:`v`. Two cohorts:

- ``alone``: the canary is the whole cohort (out: an empty cohort) -- Nasr et al. 2021's
  worst-case neighbours; any excess signal-to-noise (noise off or halved, noise added after an
  adaptive optimizer, which then passes the canary's sign at full strength) shows here;
- ``crowd``: the canary among ``CROWD`` clients that each send :math:`-2Cv` (so they are clipped to
  :math:`C` against the canary). A correct server's score moves by :math:`C/m` whatever the crowd.
  Dividing by the realised cohort instead moves it by :math:`2C/(K+1)` (the crowd's mean is
  :math:`-C` out, :math:`(1-K)C/(K+1)` in) against noise :math:`zC/(K+1)`: about twice the claimed
  signal-to-noise. Clipping after summing moves it by :math:`2C` (the clipped sum flips from
  :math:`-Cv` to :math:`+Cv`; the canary sends ``CANARY_SCALE`` :math:`C v`, more than the crowd's
  raw sum) against noise :math:`zC`: twice the claim again. The crowd is a fixed set rather than
  Poisson-sampled: the claim has no amplification, so a known cohort is fair, and a random crowd
  size would mix score scales across trials and cut the fit's power (simulated at ``m = 4``:
  detection of the realised divisor at 200 pairs fell from ~95% to 20-40%).

**The test.** Per cohort, the paired differences :math:`d_t = s_t^{in} - s_t^{out}` are
:math:`\mathcal N(\Delta, 2\sigma^2)` for a Gaussian mechanism followed by a linear optimizer (sgd with
momentum from a fresh state; the crowd's contribution cancels within a pair), and the pair is
:math:`|\Delta|/\sigma`-GDP. :func:`~fedprivacy.privacy.audit_stats.gaussian_fit` bounds that
:math:`\mu` from below with an exact noncentral-t confidence bound and
:func:`~fedprivacy.privacy.audit_stats.gdp_epsilon` converts it to epsilon (the Gaussian / f-DP
fit of Nasr et al. 2023, arXiv:2302.07956). The assumption-free Clopper-Pearson threshold bound
on the ``alone`` scores is reported beside it. The audit's lower bound is the largest of the
three, each at level ``alpha / 3`` (Bonferroni), and the audit FAILS (the CLI exits 1) when it
exceeds the claim: a correct server with a linear optimizer fails with probability at most
``alpha``. Adaptive optimizers make the score a nonlinear (sign-like) function of the release;
it is then only approximately Gaussian, with a smaller signal-to-noise than the release's.

**Cost.** The score's law under a coordinate-wise optimizer does not depend on the model's size,
so the audit caps the model at ``MAX_AUDIT_PARAMS`` parameters (fewer ``data.vocab_size`` rows).
``trials`` pairs per cohort cost ``4 * trials`` server rounds.

``BROKEN_VARIANTS`` are deliberately wrong servers that exist only to show the audit fails them.
"""

from __future__ import annotations

import logging
import math
import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from torch.nn.utils import parameters_to_vector
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedprivacy.config import RunConfig
from fedprivacy.engines.inprocess import SERVER_NODE_ID, InProcessGrid
from fedprivacy.fl import server_app
from fedprivacy.fl import strategy as strategy_module
from fedprivacy.fl.mods import answer_identity_query
from fedprivacy.fl.records import update_to_record
from fedprivacy.fl.population import discover_nodes
from fedprivacy.fl.records import model_to_record
from fedprivacy.fl.server_app import build_strategy, initial_model, noise_stream_of, resolve_noise_multiplier
from fedprivacy.fl.strategy import DPFedAvg
from fedprivacy.models.logistic import SparseLogisticRegression
from fedprivacy.outputs import strict_json
from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, accounts, epsilon
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.audit_stats import best_threshold, epsilon_lower_bound, gaussian_fit, gdp_epsilon
from fedprivacy.privacy.clipping import clip_scale
from fedprivacy.privacy.mechanism import GaussianMechanism
from fedprivacy.updates import SparseUpdate

CROWD = 8  # clients beside the canary in the ``crowd`` cohort
CROWD_SCALE = 2.0  # each crowd client sends -CROWD_SCALE * C * v: always clipped
CANARY_SCALE = CROWD_SCALE * CROWD + 2.0  # the canary's norm in units of C: clipped, and outweighs the crowd's raw sum
MAX_AUDIT_PARAMS = 20_000
COHORTS = {"alone": (), "crowd": tuple(range(1, CROWD + 1))}  # partitions beside the canary (partition 0)


@dataclass(frozen=True)
class AuditReport:
    variant: str
    trials: int  # pairs (in, out) per cohort
    delta: float
    alpha: float
    noise_multiplier: float
    mu_claimed: float
    epsilon_claimed: float  # min(epsilon_reported, epsilon_of_release)
    epsilon_reported: float  # the round's ledger: what the run reports for it
    epsilon_of_release: float  # the Gaussian of the first release's noise (multiplier ``noise_multiplier``)
    accountant: str
    gaussian: dict[str, dict[str, float]]  # per cohort: the fit and its epsilon lower bound
    threshold: dict[str, float]  # the Clopper-Pearson threshold test on the ``alone`` scores
    epsilon_lower_bound: float
    ratio_to_claim: float
    passed: bool

    def as_dict(self) -> dict:
        """Strict JSON values: an unbounded epsilon (a noiseless server) as ``"inf"``."""
        return strict_json(asdict(self))


def _audit_vocab(cfg: RunConfig) -> int:
    return max(1, min(cfg.data.vocab_size, MAX_AUDIT_PARAMS // cfg.data.num_tags))


class _AuditTask:
    """The run's model family at (at most) ``MAX_AUDIT_PARAMS`` parameters, no data (the clients are synthetic)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.population = max(cfg.privacy.expected_cohort * cfg.privacy.groups, CROWD + 1)
        self._dims = (_audit_vocab(cfg), cfg.data.num_tags)
        self.test_features = sp.csr_matrix((0, self._dims[0]), dtype=np.float32)
        self.test_labels = np.zeros(0, dtype=np.int64)
        self.majority_baseline = float("nan")

    def new_model(self, device: str = "cpu") -> SparseLogisticRegression:
        return SparseLogisticRegression(*self._dims).to(device)


class _Cohort:
    """The sampler of an audit trial: the cohort the audit chose. The canary is always in it, so the release is
    accounted without amplification: an unamplified Gaussian of multiplier ``z`` over the population."""

    def __init__(self, cohort: tuple[int, ...], population: int) -> None:
        self.cohort = np.array(cohort, dtype=np.int64)
        self.population = population

    def sample(self, release: int = 1) -> np.ndarray:
        return self.cohort

    def round_event(self, noise_multiplier: float, release: int = 1) -> GaussianRound:
        return GaussianRound(noise_multiplier, "none", self.population, float(self.population))


class _NoNoise(GaussianMechanism):
    """BROKEN on purpose: the mechanism adds no noise."""

    def privatize(self, agg: PrivateSum) -> torch.Tensor:
        agg.noise_multiplier = 0.0
        return super().privatize(agg)


class _HalfNoise(GaussianMechanism):
    """BROKEN on purpose: noise std zC/2 (e.g. a std/variance mix-up)."""

    def privatize(self, agg: PrivateSum) -> torch.Tensor:
        agg.noise_multiplier /= 2
        return super().privatize(agg)


class _RealisedDivisorMechanism(GaussianMechanism):
    """BROKEN on purpose: divides by the number of updates received, not the expected cohort."""

    def privatize(self, agg: PrivateSum) -> torch.Tensor:
        agg.expected_cohort = float(max(1, agg.stats.accepted))
        return super().privatize(agg)


class _DoubleClipHalfNoise(GaussianMechanism):
    """BROKEN on purpose: clips at 2C but draws the noise of z/2 at 2C, i.e. std zC: the std the
    claim expects, for twice the sensitivity."""

    def aggregator(self, dim: int) -> PrivateSum:
        agg = super().aggregator(dim)
        agg.clip_norm *= 2
        agg.noise_multiplier /= 2
        return agg


class _NoiseOverCohort(GaussianMechanism):
    """BROKEN on purpose: the noise is divided by m twice (std zC/m on the SUM, a units mix-up)."""

    def privatize(self, agg: PrivateSum) -> torch.Tensor:
        agg.noise_multiplier /= agg.expected_cohort
        return super().privatize(agg)


class _SumThenClip(PrivateSum):
    """Sums the updates unclipped and clips the SUM to C before the noise."""

    def add_(self, update: SparseUpdate | None, *args, **kwargs) -> bool:
        clip_norm, self.clip_norm = self.clip_norm, math.inf
        try:
            return super().add_(update, *args, **kwargs)
        finally:
            self.clip_norm = clip_norm

    def release(self, noise) -> torch.Tensor:
        self._sum.mul_(clip_scale(float(torch.linalg.vector_norm(self._sum)), self.clip_norm))
        return super().release(noise)


class _ClipAfterSumMechanism(GaussianMechanism):
    """BROKEN on purpose: clips the sum of the updates instead of each update."""

    def aggregator(self, dim: int) -> PrivateSum:
        return _SumThenClip(dim, clip_norm=self.clip_norm, noise_multiplier=self.value_noise_multiplier,
                            expected_cohort=float(self.expected_cohort), device=self.device, placement=self.placement)


def _broken(mechanism: type[GaussianMechanism]) -> type[DPFedAvg]:
    """The real strategy with a broken mechanism (no prefetched draw: the variants change it mid-round)."""
    return type(f"Broken{mechanism.__name__}", (DPFedAvg,),
                {"mechanism_cls": mechanism, "prefetch_noise": False, "__doc__": mechanism.__doc__})


class _NoiseAfterOptimizer(DPFedAvg):
    """BROKEN on purpose: the optimizer sees the clean average; noise N(0, (zC/m)^2) is added to
    the model afterwards (what Flower's DP wrappers do around an adaptive strategy)."""

    mechanism_cls = _NoNoise
    prefetch_noise = False

    def post_process(self, g: torch.Tensor, phi: float) -> None:
        super().post_process(g, phi)
        m = self.mechanism
        assert self.params is not None
        m.noise.add_(self.params, m.value_noise_multiplier * m.clip_norm / m.expected_cohort)


BROKEN_VARIANTS: dict[str, type[DPFedAvg]] = {
    "noise_off": _broken(_NoNoise), "noise_halved": _broken(_HalfNoise),
    "realised_divisor": _broken(_RealisedDivisorMechanism), "clip_after_sum": _broken(_ClipAfterSumMechanism),
    "noise_after_optimizer": _NoiseAfterOptimizer, "double_clip_half_noise": _broken(_DoubleClipHalfNoise),
    "noise_over_cohort": _broken(_NoiseOverCohort),
}


def _audit_client_app(canary: torch.Tensor, crowd: torch.Tensor) -> ClientApp:
    """Partition 0 sends ``canary``, every other partition ``crowd`` (dense updates)."""
    app = answer_identity_query(ClientApp())

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        update = canary if int(context.node_config["partition-id"]) == 0 else crowd
        content = RecordDict({"arrays": update_to_record(SparseUpdate.dense(update.clone())),
                              "metrics": MetricRecord({"train_loss": 0.0, "num-examples": 0})})
        return Message(content, reply_to=msg)

    return app


def audit_config(cfg: RunConfig, output_dir: Path) -> RunConfig:
    """The run's mechanism and server on the audit's model size, with no outputs to speak of."""
    tree = cfg.model_dump(mode="json", exclude_unset=True)  # re-validating defaults would mark them as set
    tree.update(rounds=10**9, eval_every=10**9, checkpoint_every=10**9, output_dir=str(output_dir))
    tree.setdefault("data", {})["vocab_size"] = _audit_vocab(cfg)
    correlated = cfg.privacy.mechanism.kind != "independent"  # it keeps its schedule and strategy (horizon)
    if correlated:
        tree.setdefault("privacy", {}).setdefault("mechanism", {})["horizon"] = cfg.privacy.mechanism.horizon or cfg.rounds
    tree.setdefault("privacy", {}).update(sampling="min_separated" if correlated else "fixed", accountants=["rdp"],
                                          budget_accountant="rdp", target_epsilon=None, noise_cohort=None,
                                          noise_population=None)
    return RunConfig.model_validate(tree)


def _oriented(s_in: np.ndarray, s_out: np.ndarray, n_fit: int) -> tuple[np.ndarray, np.ndarray]:
    """Scores with the sign that puts "in" above "out" on the fitting split (the threshold test decides ``> t``)."""
    sign = 1.0 if s_in[:n_fit].mean() >= s_out[:n_fit].mean() else -1.0
    return sign * s_in, sign * s_out


def _trial_scores(strategy_cls: type[DPFedAvg], cfg: RunConfig,
                  trials: int) -> tuple[dict[tuple[str, bool], np.ndarray], PrivacyLedger]:
    """``trials`` scores per (cohort, canary present): each one fresh run's round, projected on the canary; and
    the ledger a trial's round composed (the same event every trial: checked)."""
    task = _AuditTask(cfg)
    dim = sum(p.numel() for p in task.new_model().parameters())
    direction = torch.randn(dim, generator=torch.Generator().manual_seed(cfg.seed))
    direction /= direction.norm()
    c = cfg.privacy.clip_norm
    grid = InProcessGrid(_audit_client_app(CANARY_SCALE * c * direction, -CROWD_SCALE * c * direction),
                         task.population)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, SERVER_NODE_ID
    nodes = discover_nodes(grid, task.population)
    scores = {(name, present): np.empty(trials) for name in COHORTS for present in (True, False)}
    ledgers = set()
    quiet = {logging.getLogger(server_app.__name__): logging.WARNING,  # a line per trial round would bury
             logging.getLogger(strategy_module.__name__): logging.ERROR}  # the report, so would the seed's warning
    levels = {logger: logger.level for logger in quiet}
    for logger, level in quiet.items():
        logger.setLevel(level)
    try:
        with tempfile.TemporaryDirectory() as tmp:
            seed = cfg.seed
            for t in range(trials):
                for (name, present), out in scores.items():
                    seed += 1
                    trial_cfg = resolve_noise_multiplier(
                        audit_config(cfg.model_copy(update={"seed": seed}), Path(tmp) / str(seed)), task.population, dim)
                    model = initial_model(task, trial_cfg.seed, trial_cfg.device)
                    strategy = build_strategy(trial_cfg, task.population, model, strategy_cls)
                    strategy.use_population(nodes)
                    mechanism = strategy.mechanism
                    mechanism.sampler = _Cohort(((0,) if present else ()) + COHORTS[name], task.population)
                    start = parameters_to_vector(model.parameters()).detach()
                    strategy.start(grid, model_to_record(model), num_rounds=1, timeout=trial_cfg.round_timeout_s)
                    assert strategy.params is not None
                    out[t] = float((strategy.params - start) @ direction)
                    ledgers.add(mechanism.ledger.entries)
    finally:
        for logger, level in levels.items():
            logger.setLevel(level)
    if len(ledgers) != 1:
        raise RuntimeError(f"the audit's trial rounds were accounted differently: {sorted(map(str, ledgers))}")
    return scores, PrivacyLedger(ledgers.pop())


def run_audit(cfg: RunConfig, *, trials: int = 500, delta: float = 1e-5, alpha: float = 0.05,
              fit_fraction: float = 0.2, variant: str = "correct", accountant: str = "pld") -> AuditReport:
    """Audit one round of ``cfg``'s mechanism + server; ``variant`` selects a broken server to test the audit."""
    if variant != "correct" and variant not in BROKEN_VARIANTS:
        raise ValueError(f"audit variant must be 'correct' or one of {sorted(BROKEN_VARIANTS)}, got {variant!r}")
    if cfg.privacy.noise_multiplier == "auto":
        raise ValueError("the audit needs a numeric privacy.noise_multiplier (it audits one round without data); "
                         "get it with `fedprivacy calibrate` or from a calibrated run's config.yaml")
    if trials < 10:
        raise ValueError(f"audit trials must be at least 10 pairs, got {trials}")
    if cfg.privacy.secure_aggregation is not None:
        raise ValueError("the audit fits a Gaussian to one round of the server's release; privacy.secure_aggregation's "
                         "Skellam rounds are checked by tests/engine/test_secure_aggregation.py (noise std, exact sums) "
                         "instead: audit the config without it")
    scores, ledger = _trial_scores(DPFedAvg if variant == "correct" else BROKEN_VARIANTS[variant], cfg, trials)
    each = alpha / 3  # Bonferroni over the two Gaussian fits and the threshold test
    gaussian = {}
    for name in COHORTS:
        fit = gaussian_fit(scores[name, True] - scores[name, False], each)
        gaussian[name] = {"mean_shift": fit.mean, "score_std": fit.std / math.sqrt(2), "mu": fit.mu,
                          "mu_lower_bound": fit.mu_lower_bound,
                          "epsilon_lower_bound": gdp_epsilon(fit.mu_lower_bound, delta)}
    n_fit = max(1, int(fit_fraction * trials))
    s_in, s_out = _oriented(scores["alone", True], scores["alone", False], n_fit)
    cut = best_threshold(s_in[:n_fit], s_out[:n_fit])
    fn, fp, n_eval = int((s_in[n_fit:] <= cut).sum()), int((s_out[n_fit:] > cut).sum()), trials - n_fit
    threshold = {"threshold": cut, "false_positives": fp, "false_negatives": fn, "evaluated_per_side": n_eval,
                 "epsilon_lower_bound": epsilon_lower_bound(fp, n_eval, fn, n_eval, delta, each)}
    lower = max(threshold["epsilon_lower_bound"], *(g["epsilon_lower_bound"] for g in gaussian.values()))
    m = cfg.privacy.expected_cohort
    # Release 1 alone: sensitivity C, noise z C f_1 (f_1 = 1 for independent noise; a correlated strategy's first
    # release carries its sensitivity factor), so its own claim is a Gaussian of multiplier z f_1.
    z = cfg.privacy.noise_multiplier * noise_stream_of(cfg)(0).std_factor(1)
    of_release = float(epsilon(PrivacyLedger().compose(GaussianRound(z, "none", m, float(m))), delta, accountant))
    reported = epsilon(ledger, delta, accountant if accounts(ledger, accountant) else "rdp")
    assert reported is not None  # rdp accounts every registered event
    claimed = min(reported, of_release)
    return AuditReport(variant=variant, trials=trials, delta=delta, alpha=alpha, noise_multiplier=z,
                       mu_claimed=1 / z if z > 0 else math.inf, epsilon_claimed=claimed, epsilon_reported=reported,
                       epsilon_of_release=of_release, accountant=accountant,
                       gaussian=gaussian, threshold=threshold, epsilon_lower_bound=lower,
                       ratio_to_claim=0.0 if math.isinf(claimed) else lower / claimed, passed=lower <= claimed)
