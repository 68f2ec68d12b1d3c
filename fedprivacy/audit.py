"""``fedprivacy audit``: an empirical lower bound on the epsilon of one DP-FedAvg round.

Each trial runs the REAL server round (``DPFedAvgServer``, its aggregation, noise and server
optimizer, through the in-process Flower grid) from a fresh state, with every one of ``m``
clients in the cohort (fixed-size sampling of ``m`` out of ``m``):

- a canary client sends a fixed random direction scaled to ``10 C`` (so it is clipped to ``C``);
  every other client sends zero (the worst-case neighbours);
- "in" trials include the canary, "out" trials replace it by a zero update;
- the statistic is the released model change projected on the canary direction.

A threshold is fitted on the first ``fit_fraction`` of the trials; the error counts on the rest
give a Clopper-Pearson lower bound on epsilon (:mod:`fedprivacy.privacy.audit_stats`). The claim
it is compared with is the epsilon of ONE round of the configured Gaussian mechanism without
sampling amplification (the canary is always in the cohort), by default under PLD (the tightest
valid bound here, so the audit is as sensitive as it can be).
The audit fails (``passed = False``, the CLI exits 1) when the lower bound exceeds the claim.

``BROKEN_VARIANTS`` are deliberately wrong servers (noise switched off; noise added after the
server optimizer) that exist only to show that the audit can fail.
"""

from __future__ import annotations

import tempfile
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import scipy.sparse as sp
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.supercore.task_identity import TaskIdentity

from fedprivacy.config import RunConfig
from fedprivacy.engines.inprocess import SERVER_NODE_ID, InProcessGrid
from fedprivacy.fl.records import update_to_record
from fedprivacy.fl.server_app import DPFedAvgServer, discover_nodes
from fedprivacy.models.logistic import SparseLogisticRegression
from fedprivacy.privacy.accounting import GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.aggregation import PrivateSum, SparseUpdate
from fedprivacy.privacy.audit_stats import best_threshold, epsilon_lower_bound

CANARY_SCALE = 10.0  # the canary's norm in units of C: always clipped


@dataclass(frozen=True)
class AuditReport:
    variant: str
    trials_per_side: int
    threshold: float
    false_positives: int
    false_negatives: int
    evaluated_per_side: int
    epsilon_lower_bound: float
    epsilon_claimed: float
    accountant: str
    delta: float
    passed: bool

    def as_dict(self) -> dict:
        return asdict(self)


class _AuditTask:
    """The model shape of the run's task, no data (the audit's clients are synthetic)."""

    def __init__(self, cfg: RunConfig) -> None:
        self.population = cfg.privacy.expected_cohort
        self._dims = (cfg.data.vocab_size, cfg.data.num_tags)
        self.test_features = sp.csr_matrix((0, cfg.data.vocab_size), dtype=np.float32)
        self.test_labels = np.zeros(0, dtype=np.int64)
        self.majority_baseline = float("nan")

    def new_model(self, device: str = "cpu") -> SparseLogisticRegression:
        return SparseLogisticRegression(*self._dims).to(device)


class _NoiseOff(DPFedAvgServer):
    """BROKEN on purpose: the mechanism adds no noise."""

    prefetch_noise = False

    def _privatize_and_step(self, agg: PrivateSum) -> None:
        agg.noise_multiplier = 0.0
        super()._privatize_and_step(agg)


class _NoiseAfterOptimizer(DPFedAvgServer):
    """BROKEN on purpose: the optimizer sees the clean average; noise N(0, (zC/m)^2) is added to
    the model afterwards (what Flower's DP wrappers do around an adaptive strategy)."""

    prefetch_noise = False

    def _privatize_and_step(self, agg: PrivateSum) -> None:
        std = agg.noise_multiplier * agg.clip_norm / agg.expected_cohort
        agg.noise_multiplier = 0.0
        super()._privatize_and_step(agg)
        self.noise.add_(self.params, std)


BROKEN_VARIANTS: dict[str, type[DPFedAvgServer]] = {"noise_off": _NoiseOff, "noise_after_optimizer": _NoiseAfterOptimizer}


def _canary_client_app(state: dict) -> ClientApp:
    app = ClientApp()

    @app.query()
    def query(msg: Message, context: Context) -> Message:
        from flwr.app import ConfigRecord

        return Message(RecordDict({"node": ConfigRecord({"partition-id": int(context.node_config["partition-id"])})}),
                       reply_to=msg)

    @app.train()
    def train(msg: Message, context: Context) -> Message:
        canary = state["present"] and int(context.node_config["partition-id"]) == 0
        update = SparseUpdate.dense(state["canary"].clone()) if canary else SparseUpdate(
            torch.zeros(0, dtype=torch.int64), torch.zeros(0), state["canary"].numel())
        content = RecordDict({"arrays": update_to_record(update),
                              "metrics": MetricRecord({"train_loss": 0.0, "num-examples": 0})})
        return Message(content, reply_to=msg)

    return app


def audit_config(cfg: RunConfig, output_dir: Path) -> RunConfig:
    """The run's mechanism and server, with every client in every cohort and no outputs to speak of."""
    tree = cfg.model_dump(mode="json", exclude_unset=True)  # re-validating defaults would mark them as set
    tree.update(rounds=10**9, eval_every=10**9, checkpoint_every=10**9, output_dir=str(output_dir))
    tree.setdefault("privacy", {}).update(sampling="fixed", accountants=["rdp"], budget_accountant="rdp", target_epsilon=None,
                           noise_cohort=None, noise_population=None)
    return RunConfig.model_validate(tree)


def run_audit(cfg: RunConfig, *, trials: int = 500, delta: float = 1e-5, alpha: float = 0.05,
              fit_fraction: float = 0.2, variant: str = "correct", accountant: str = "pld") -> AuditReport:
    """Audit one round of ``cfg``'s mechanism + server; ``variant`` selects a broken server to test the audit."""
    if variant != "correct" and variant not in BROKEN_VARIANTS:
        raise ValueError(f"audit variant must be 'correct' or one of {sorted(BROKEN_VARIANTS)}, got {variant!r}")
    if cfg.privacy.noise_multiplier == "auto":
        raise ValueError("the audit needs a numeric privacy.noise_multiplier (it audits one round without data); "
                         "get it with `fedprivacy calibrate` or from a calibrated run's config.yaml")
    if trials < 10:
        raise ValueError(f"audit trials must be at least 10 per side, got {trials}")
    server_cls = DPFedAvgServer if variant == "correct" else BROKEN_VARIANTS[variant]
    m = cfg.privacy.expected_cohort
    task = _AuditTask(cfg)
    dim = sum(p.numel() for p in task.new_model().parameters())
    direction = torch.randn(dim, generator=torch.Generator().manual_seed(cfg.seed))
    direction /= direction.norm()
    state = {"present": False, "canary": direction * CANARY_SCALE * cfg.privacy.clip_norm}
    grid = InProcessGrid(_canary_client_app(state), m)
    TaskIdentity.run_id, TaskIdentity.task_id, TaskIdentity.node_id = grid.run.run_id, 1, SERVER_NODE_ID
    nodes = discover_nodes(grid, m)
    scores: dict[bool, list[float]] = {True: [], False: []}
    with tempfile.TemporaryDirectory() as tmp:
        for t in range(trials):
            for present in (True, False):
                trial_cfg = audit_config(cfg.model_copy(update={"seed": cfg.seed + 2 * t + int(present)}),
                                         Path(tmp) / f"t{t}{int(present)}")
                server = server_cls(trial_cfg, task)
                server.outputs.prepare(resume=False)
                start = server.params.clone()
                state["present"] = present
                server._run_round(grid, nodes, server._round_event())
                scores[present].append(float((server.params - start) @ direction))
    s_in, s_out = np.array(scores[True]), np.array(scores[False])
    n_fit = max(1, int(fit_fraction * trials))
    threshold = best_threshold(s_in[:n_fit], s_out[:n_fit])
    fn = int((s_in[n_fit:] <= threshold).sum())
    fp = int((s_out[n_fit:] > threshold).sum())
    n_eval = trials - n_fit
    lower = epsilon_lower_bound(fp, n_eval, fn, n_eval, delta, alpha)
    kind = accountant
    one_round = PrivacyLedger().compose(GaussianRound(cfg.privacy.noise_multiplier, "none", m, float(m)))
    claimed = float(epsilon(one_round, delta, kind))
    return AuditReport(variant=variant, trials_per_side=trials, threshold=threshold, false_positives=fp,
                       false_negatives=fn, evaluated_per_side=n_eval, epsilon_lower_bound=lower,
                       epsilon_claimed=claimed, accountant=kind, delta=delta, passed=lower <= claimed)
