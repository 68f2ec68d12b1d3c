"""fedprivacy's ServerApp: the :class:`~fedprivacy.fl.strategy.DPFedAvg` strategy's rounds plus what a run
adds around them, as pfl-research keeps checkpointing and evaluation outside its algorithms.

The round itself (budget check, sampling over the full population, broadcast, reply triage, clip and sum,
the release logged ahead with ONE noise draw and the fixed divisor, :class:`ServerStep`, accounting) is
the strategy's, the same code a hand-written Flower ``ServerApp`` runs with it: both give bit-identical
models and ledgers. What the run adds (:class:`DPFedAvgServer`):

- the configuration: z calibrated from ``privacy.target_epsilon`` (``noise_multiplier: auto``), the
  strategy built from ``cfg`` (:func:`build_strategy`), the initial model from the run seed;
- the population in partition order (:func:`~fedprivacy.fl.population.discover_nodes`), so that client
  ``i``'s data and ledger line are partition ``i``'s on every engine;
- AdaDPS's side information (:class:`~fedprivacy.fl.side_information.SideInformationBroadcast`, the
  strategy's :class:`~fedprivacy.fl.strategy.NodeContent`), rebuilt at the released ``x_t`` when due;
- evaluation every ``eval_every`` rounds, ``metrics.csv``, a checkpoint every ``checkpoint_every`` rounds
  (the strategy's state, the side information, the in-process nodes' state) beside the strategy's
  write-ahead release log, ``summary.json``, ``client_privacy.csv``, the initial and final models;
- the ``tracking`` section's TensorBoard and MLflow logs (:mod:`fedprivacy.tracking`), which get each
  ``metrics.csv`` row once it is checkpointed (so that a resume has nothing to take back).

Flower's DP wrappers are NOT used: they add noise after the wrapped strategy's step.
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, MetricRecord
from flwr.serverapp import Grid, ServerApp
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fedprivacy.config import ConfigError, MicroAdamConfig, RunConfig
from fedprivacy.fl.canaries import RunCanaries
from fedprivacy.fl.population import discover_nodes
from fedprivacy.fl.records import model_to_record
from fedprivacy.fl.run_config import config_from_context
from fedprivacy.fl.secure_aggregation import SecureAggregation
from fedprivacy.fl.side_information import SideInformationBroadcast
from fedprivacy.fl.strategy import DPFedAvg, NodeContent
from fedprivacy.callbacks import RoundCallback
from fedprivacy.outputs import RunOutputs, noise_mechanism
from fedprivacy.privacy.accounting import PrivacyLedger, epsilon
from fedprivacy.privacy.calibration import calibrate_noise_multiplier, solve_noise_multiplier
from fedprivacy.privacy.correlated import CorrelatedMechanism
from fedprivacy.privacy.mechanism import AdaptiveClipping, NoiseStreamFactory, planned_ledger
from fedprivacy.privacy.noise import GaussianNoise, stream_name, torch_seed
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.stackoverflow_tasks import data_provenance, ensure_data, load_task
from fedprivacy.stopping import RunStopped, stop_requested
from fedprivacy.task import Task
from fedprivacy.tracking import RunTracker, open_tracker

log = logging.getLogger(__name__)

MODEL_INIT_STREAM = 0x696E6974  # "init": the initial model's random initialisation, per run seed


def server_optimizer_settings(cfg: RunConfig, model: torch.nn.Module) -> dict[str, Any]:
    """The configured server optimizer's settings (:func:`~fedprivacy.optim.factory.make_server_optimizer`);
    DP-FedAdamBC's Phi, unless given, comes from the mechanism (:class:`DPFedAvg`)."""
    s = cfg.server
    settings: dict[str, Any] = {k: getattr(s, k) for k in s.explicit_settings()}
    if s.optimizer == "microadam":
        m = s.microadam or MicroAdamConfig()
        settings["microadam"] = {
            "density": m.density, "ring_size": m.ring_size, "bucket_size": m.bucket_size,
            "stochastic_rounding": m.stochastic_rounding, "seed": cfg.seed, "device": cfg.device,
            "per_tensor_sizes": [q.numel() for q in model.parameters()] if m.per_tensor else None,
        }
    return settings


def plugin_factory(field: str, spec: str) -> Any:
    """The factory a plug-in field (:func:`~fedprivacy.config.plugins`) names as ``module:attribute``.

    Raises:
        ConfigError: it cannot be imported, or is not callable (naming the field).
    """
    module, _, name = spec.partition(":")
    try:
        factory: Any = importlib.import_module(module)
        for part in name.split("."):
            factory = getattr(factory, part)
    except (ImportError, AttributeError) as err:
        raise ConfigError(f"{field}={spec!r} cannot be imported: {err}") from None
    if not callable(factory):
        raise ConfigError(f"{field}={spec!r} is not a callable factory")
    return factory


def _named_or_plugin(field: str, value: str) -> Any:
    """A built-in part's name as it is, a plug-in's (``module:factory``) factory."""
    return plugin_factory(field, value) if ":" in value else value


def noise_stream_of(cfg: RunConfig) -> NoiseStreamFactory:
    """The run's noise-stream factory: ``privacy.mechanism`` (a :class:`CorrelatedMechanism` over ``horizon`` or
    ``rounds`` releases; BandMF under cyclic Poisson amplified) or ``privacy.noise_stream`` (None: independent
    Gaussian noise)."""
    p, m = cfg.privacy, cfg.privacy.mechanism
    if m.kind == "independent":
        return GaussianNoise if p.noise_stream is None else plugin_factory("privacy.noise_stream", p.noise_stream)
    return CorrelatedMechanism(kind=m.kind, horizon=m.horizon or cfg.rounds, groups=p.groups, bands=m.bands,
                               buffers=m.buffers, amplified=m.kind == "bandmf" and p.sampling == "cyclic_poisson")


def build_strategy(cfg: RunConfig, population: int, model: torch.nn.Module, cls: type[DPFedAvg] = DPFedAvg,
                   node_content: NodeContent | None = None) -> DPFedAvg:
    """The run's :class:`DPFedAvg` (a ``cls``) from ``cfg`` over ``population`` users training ``model``."""
    p, s = cfg.privacy, cfg.server
    assert p.noise_multiplier != "auto", "resolve_noise_multiplier first"
    adaptive = (AdaptiveClipping(p.adaptive_clipping.target_quantile, p.adaptive_clipping.learning_rate,
                                 p.count_stddev) if p.adaptive_clipping else None)
    return cls(noise_multiplier=p.noise_multiplier, clip_norm=p.clip_norm, expected_cohort=p.expected_cohort,
               population=population, sampling=_named_or_plugin("privacy.sampling", p.sampling), placement=p.placement,
               optimizer=_named_or_plugin("server.optimizer", s.optimizer), lr=s.lr,
               optimizer_settings=server_optimizer_settings(cfg, model), adaptive_clipping=adaptive,
               disk_kappa=s.disk.kappa if s.disk else None, disk_gamma=s.disk.gamma if s.disk else 0.5,
               record_level=cfg.client.sample_dp is not None, delta=p.delta, target_epsilon=p.target_epsilon,
               budget_accountant=p.budget_accountant, accountants=tuple(p.accountants),
               seed=None if p.secure_noise else cfg.seed, noise_cohort=p.noise_cohort,
               noise_population=p.noise_population, device=cfg.device,
               noise_stream=noise_stream_of(cfg), groups=p.groups, node_content=node_content,
               secure_aggregation=None if p.secure_aggregation is None else SecureAggregation(
                   p.secure_aggregation.threshold, p.secure_aggregation.neighbours, p.secure_aggregation.bits,
                   p.secure_aggregation.timeout_s))


def resolve_noise_multiplier(cfg: RunConfig, population: int, dim: int | None = None) -> RunConfig:
    """``privacy.noise_multiplier: auto`` replaced by its calibrated value (any other config unchanged).

    z is :func:`~fedprivacy.privacy.calibration.calibrate_noise_multiplier` for ``target_epsilon``
    after ``rounds`` rounds of exactly the events this server will account (its sampling, the claim's
    population and cohort, ``delta`` or 1 / population, ``budget_accountant``), so the budget check
    never stops the run early and the final epsilon is within 1% below the target. Under secure aggregation:
    the Skellam rounds (RDP) of a model of ``dim`` values with ``threshold`` shares, the fewest a round can
    complete with, which is what the budget check assumes of the next round (so the run never exceeds the
    target whoever drops out); rounds where more survive spend less.
    """
    p = cfg.privacy
    if p.noise_multiplier != "auto":
        return cfg
    claim_population = p.noise_population or population
    delta = p.delta if p.delta is not None else 1.0 / claim_population
    if p.secure_aggregation is not None:  # Skellam rounds of a model of ``dim`` values, as few shares as can release
        from fedprivacy.privacy.skellam import SkellamParams

        assert dim is not None, "secure aggregation calibrates on the model's size"
        sa = p.secure_aggregation

        def skellam_eps(z: float) -> float:
            params = SkellamParams(dim=dim, clip_norm=p.clip_norm, noise_multiplier=z,
                                   expected_cohort=p.expected_cohort, bits=sa.bits)
            planned = PrivacyLedger([(params.event(sa.threshold, p.expected_cohort / population), cfg.rounds)])
            value = epsilon(planned, delta, "rdp")
            assert value is not None
            return value
        z = solve_noise_multiplier(skellam_eps, p.target_epsilon, accountant="rdp", delta=delta)
    elif p.sampling in ("poisson", "fixed") and p.mechanism.kind == "independent":
        z = calibrate_noise_multiplier(p.target_epsilon, delta, sampling=p.sampling, population=claim_population,
                                       expected_cohort=float(p.accounting_cohort), rounds=cfg.rounds,
                                       accountant=p.budget_accountant)
    else:  # cyclic schedules, correlated mechanisms: the events the run's own mechanism will account
        def eps(z: float) -> float:
            planned = planned_ledger(z, cfg.rounds, expected_cohort=p.expected_cohort, population=population,
                                     sampling=_named_or_plugin("privacy.sampling", p.sampling), groups=p.groups,
                                     noise_stream=noise_stream_of(cfg),
                                     noise_cohort=p.noise_cohort, noise_population=p.noise_population)
            value = epsilon(planned, delta, p.budget_accountant)
            assert value is not None, "the config validator refuses an accountant that cannot account the run"
            return value
        z = solve_noise_multiplier(eps, p.target_epsilon, accountant=p.budget_accountant, delta=delta)
    log.info("privacy.noise_multiplier calibrated to %.6g for epsilon %g after %d rounds (%s)",
             z, p.target_epsilon, cfg.rounds, p.budget_accountant)
    tree = cfg.model_dump(mode="json", exclude_unset=True)
    tree["privacy"]["noise_multiplier"] = z
    return RunConfig.model_validate(tree)


def initial_model(task: Task, seed: int, device: str) -> torch.nn.Module:
    """``x_0``: the task's new model, its random initialisation drawn from the run seed
    (:data:`MODEL_INIT_STREAM`), not from torch's global generator, whose state depends on whatever ran
    before in the process (a sweep worker runs several runs; clients build models too). torch's CPU
    generator is restored afterwards; ``torch.manual_seed`` also seeds CUDA's, for a model built there."""
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(torch_seed(np.random.SeedSequence([seed, MODEL_INIT_STREAM])))
        return task.new_model(device)


class DPFedAvgServer:
    """One run of ``cfg``: the strategy's rounds against a Flower ``Grid``, and the run's files (module docstring).

    Args:
        cfg: the run's configuration.
        task: the data and model.
        on_round: called with ``(round, metrics row)`` after each round is recorded (e.g. a progress display).
        strategy_cls: the strategy's class (the audit's broken variants substitute theirs).
    """

    def __init__(self, cfg: RunConfig, task: Task, on_round: RoundCallback | None = None,
                 strategy_cls: type[DPFedAvg] = DPFedAvg) -> None:
        self.model = initial_model(task, cfg.seed, cfg.device)  # x_0 depends on the seed, not on z
        dim = sum(p.numel() for p in self.model.parameters())
        c = cfg.privacy.canaries  # canary clients: members of the population (fedprivacy.fl.canaries)
        self.canaries = RunCanaries(c, task.population, dim) if c is not None else None
        self.initial_params = parameters_to_vector(self.model.parameters()).detach().clone() if c else None
        self.population = task.population + (c.count if c else 0)
        self.cfg = cfg = resolve_noise_multiplier(cfg, self.population, dim)
        self.task, self.on_round = task, on_round
        self.side_info = SideInformationBroadcast(cfg, task) if cfg.client.adadps else None
        self.strategy = build_strategy(cfg, self.population, self.model, strategy_cls, self.side_info)
        self.strategy.rounds_planned = cfg.rounds
        self.strategy.adopt(model_to_record(self.model))
        self.outputs = RunOutputs(cfg)
        self.grid: Grid | None = None
        self.tracker: RunTracker | None = None

    @property
    def params(self) -> torch.Tensor:
        """``x_t``, flat (the strategy's)."""
        assert self.strategy.params is not None
        return self.strategy.params

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The strategy's state, the side information and, where this engine holds them (in-process), the
        clients' own states (real SuperNodes keep theirs)."""
        return {**self.strategy.state_dict(),
                "side_information": self.side_info.state_dict() if self.side_info else None,
                "canaries": self.canaries.state_dict() if self.canaries else None,
                "node_states": self.grid.node_state_dict() if hasattr(self.grid, "node_state_dict") else None}

    def _resume(self, checkpoint: dict[str, Any] | None, grid: Grid) -> None:
        """Continue from ``checkpoint`` (None: a fresh run) with every logged release accounted."""
        if checkpoint is None:
            self.outputs.save_model("initial_model.pt", self._model_state())
        else:
            if self.side_info:
                self.side_info.load_state_dict(checkpoint["side_information"])
            if self.canaries:
                if checkpoint.get("canaries") is None:
                    raise ConfigError("privacy.canaries is set but the checkpoint holds no canaries (the run started "
                                      "without them): a run's canaries are part of its population from round 1")
                self.canaries.load_state_dict(checkpoint["canaries"])
        self.strategy.resume(checkpoint, ReleaseLog(self.outputs.dir))
        if checkpoint is None:
            return
        log.info("resumed from round %d (epsilon so far kept in the ledger)", self.strategy.round)
        if checkpoint.get("node_states") and hasattr(grid, "load_node_state_dict"):
            grid.load_node_state_dict(checkpoint["node_states"])
        elif self.cfg.client.compression is not None:
            log.warning("this engine keeps no client state across a resume: uplink residuals restart at zero")

    def privacy_claim(self) -> str:
        """What the reported epsilon means, in words (written to the summary)."""
        p = self.cfg.privacy
        who = (f"a DEPLOYMENT with cohort {p.noise_cohort} of {self.strategy.mechanism.claim_population} users (large-cohort "
               f"emulation: this simulation used cohort {p.expected_cohort} of {self.population} users with "
               f"noise scaled by {p.expected_cohort}/{p.noise_cohort}; the epsilon does NOT hold for the simulation)"
               if p.noise_cohort else f"this run: cohort {p.expected_cohort} of {self.population} users")
        where = {"central": "noise added by the server (trusted server)",
                 "distributed": "noise shares added by the clients (against the server: assumes secure "
                                "aggregation, and holds only in rounds whose server_noise_std top-up is 0)",
                 "local": "noise added by each client to its own upload (per-client local epsilon in "
                          "client_privacy.csv)"}[p.placement]
        sa = p.secure_aggregation
        if sa is not None:
            where = (f"Skellam noise shares added by the clients and summed under SecAgg+ (threshold {sa.threshold} of "
                     f"{sa.neighbours} neighbours, modulus 2^{sa.bits}): the server sees each client's upload only "
                     "masked (uniform mod 2^bits) and learns only the sum of the survivors' noisy shares; it cannot see "
                     "any single update, norm or training loss. Holds against a server that sends any messages (lies "
                     "about dropouts, neighbourhoods or the threshold: each client checks them against its own "
                     "settings, signatures and a consistency round) colluding with c clients of a neighbourhood while "
                     f"2*threshold > neighbours + c (here {2 * sa.threshold - sa.neighbours - 1} colluders at most); each "
                     "round is accounted with the noise its surviving clients actually added (RDP of the Skellam "
                     "mechanism, no top-up). Not covered: a server that invents clients or substitutes their keys "
                     "unless the clients hold a roster of trusted identity keys, agreement on the survivor set across "
                     "distant parts of the neighbour ring, or a server that distributes a config with less noise")
        records = ("; clients train with sample-level DP (record-level epsilon of each client, at its own delta, "
                   "in client_privacy.csv)" if self.cfg.client.sample_dp is not None else "")
        side = ("; AdaDPS side information built from public inputs only (provenance in side_information.json)"
                if self.side_info else "")
        randomness = ("server noise and cohort drawn from the OS's cryptographic source" if p.secure_noise else
                      f"SIMULATION: the server's noise and the cohort are reproducible from seed {self.cfg.seed} "
                      "(privacy.secure_noise makes them unpredictable)")
        clients = ("; client-side noise from the seed on fedprivacy's simulation engines, from each device's "
                   "cryptographic source on real SuperNodes" if p.placement != "central" or records else "")
        weak = (" >= 1/population: permits publishing a random user's data in full" if
                self.strategy.delta >= 1 / self.strategy.mechanism.claim_population else "")
        return (f"user-level ({p.sampling} sampling, delta={self.strategy.delta:.3g}{weak}) for {who}; {where}{records}{side}; "
                f"{randomness}{clients}")

    def _model_state(self) -> dict[str, torch.Tensor]:
        vector_to_parameters(self.params, self.model.parameters())
        return self.model.state_dict()

    # -- rounds -----------------------------------------------------------------------------
    def run(self, grid: Grid, resume: bool = False) -> dict[str, Any]:
        """Run rounds until ``cfg.rounds`` or the privacy budget; return the summary."""
        self.grid = grid
        checkpoint = self.outputs.prepare(resume)
        m, p = self.strategy.mechanism, self.cfg.privacy
        self.outputs.write_json("noise_mechanism.json", noise_mechanism(
            stream_name(m.noise_stream), m.noise, noise_multiplier=m.noise_multiplier, clip_norm=p.clip_norm,
            sampling=p.sampling, groups=p.groups,
            placement="secure aggregation (Skellam)" if p.secure_aggregation else p.placement))
        log.info("privacy: %s", self.privacy_claim())
        self._resume(checkpoint, grid)
        if self.canaries:  # after the resume: the canaries' seed and statistic are the checkpoint's
            self.grid = grid = self.canaries.grid(grid)
            self.canaries.start(self.params)
        self.strategy.use_population(discover_nodes(grid, self.population), labels=range(self.population))
        with open_tracker(self.outputs.dir, self.cfg.tracking, json.loads(self.cfg.to_json()),
                          self.cfg.privacy.placement, resume=checkpoint is not None) as self.tracker:
            self.tracker.log_rows(self.outputs.rows)  # checkpointed rounds a tracker may lack (a crash, or newly on)
            stop_reason, k = "rounds", 1
            while self.strategy.round < self.cfg.rounds:
                if not self._run_round(grid, k):
                    stop_reason = "privacy_budget"
                    break
                if stop_requested() and self.strategy.round < self.cfg.rounds:
                    self._checkpoint()
                    raise RunStopped(f"stopped on request after round {self.strategy.round}; its checkpoint holds "
                                     "every release: --resume continues with nothing lost")
                k += 1
            self.outputs.save_model("final_model.pt", self._model_state())
            self._checkpoint()
            summary = self._summary(stop_reason)
            self.outputs.finish(summary)
        return summary

    def _checkpoint(self) -> None:
        """Save the checkpoint, then give the trackers the rows it holds."""
        self.outputs.save_checkpoint(self.state_dict())
        assert self.tracker is not None
        self.tracker.log_rows(self.outputs.rows)

    def _summary(self, stop_reason: str) -> dict[str, Any]:
        """``summary.json``: how the run ended, its privacy claim, its last metrics; ``client_privacy.csv``."""
        s, p = self.strategy, self.cfg.privacy
        summary = {"rounds_completed": s.round, "stop_reason": stop_reason, "delta": s.delta,
                   "population": self.population, "engine": self.cfg.engine, "noise_multiplier": p.noise_multiplier,
                   "majority_baseline_accuracy": self.task.majority_baseline, "privacy_claim": self.privacy_claim(),
                   "releases": s.mechanism.ledger.rounds, "rounds_with_no_accepted_update": s.empty_rounds,
                   "data": data_provenance(self.cfg.data), **(self.outputs.rows[-1] if self.outputs.rows else {})}
        if self.side_info:
            summary["side_information"] = self.side_info.builds[-1]
        if self.canaries:
            assert self.initial_params is not None
            accountant = p.budget_accountant
            summary["empirical_epsilon"] = {
                **self.canaries.estimates(self.params - self.initial_params.to(self.params.device), s.delta),
                "accountant": accountant, "epsilon_claimed": summary.get(f"epsilon_{accountant}")}
        if len(s.client_ledgers):  # per-client guarantees: a file with every client, extremes in the summary
            s.client_ledgers.write_csv(self.outputs.dir / "client_privacy.csv", s.delta, list(p.accountants))
            summary.update(s.client_ledgers.summary(s.delta, p.budget_accountant))
        return summary

    def _run_round(self, grid: Grid, k: int) -> bool:
        """The strategy's round ``k`` of this start (the run's round ``strategy.round + 1``), as Flower's loop
        runs it, then evaluation and the round's records; False if the budget stopped the run before it."""
        t0, s = time.perf_counter(), self.strategy
        self._refresh_side_information()
        messages = list(s.configure_train(k, s.arrays, ConfigRecord(), grid))
        if s.stopped:
            return False
        side_info_bytes = sum(self.side_info.bytes_for(node) for node in s.cohort) if self.side_info else 0
        _, metrics = s.aggregate_train(k, grid.send_and_receive(messages, timeout=self.cfg.round_timeout_s))
        assert metrics is not None
        if self.canaries:  # the every-round statistic, before the round's checkpoint
            self.canaries.observe(self.params)
        row = self._metrics_row(metrics)
        if self.side_info:
            row["side_information_bytes"] = float(side_info_bytes)
        row["seconds"] = time.perf_counter() - t0
        self._record(row)
        return True

    def _metrics_row(self, metrics: MetricRecord) -> dict[str, float]:
        """The round's metrics.csv row: the strategy's metrics, and the evaluation when due."""
        t = self.strategy.round
        row: dict[str, float] = {"round": t, "train_loss": float("nan"), "test_loss": float("nan"),
                                 "test_accuracy": float("nan")}
        row.update({k: float(v) for k, v in metrics.items()})  # type: ignore[arg-type]
        if t % self.cfg.eval_every == 0 or t == self.cfg.rounds:
            vector_to_parameters(self.params, self.model.parameters())
            row.update(self.task.evaluate(self.model))
        return row

    def _record(self, row: dict[str, float]) -> None:
        """Write the round's metrics.csv row, checkpoint when due, and log one line."""
        t = self.strategy.round
        self.outputs.log_round(row)
        if t % self.cfg.checkpoint_every == 0:
            self._checkpoint()
        accountant = self.cfg.privacy.budget_accountant
        accuracy = row.get("test_accuracy", float("nan"))
        log.info("round %d: cohort %d, eps(%s) %.4g, %.2fs%s", t, int(row["cohort_sampled"]), accountant,
                 row[f"epsilon_{accountant}"], row["seconds"],
                 f", test accuracy {accuracy:.4f}" if accuracy == accuracy else "")
        if self.on_round is not None:
            self.on_round(t, row)

    def _refresh_side_information(self) -> None:
        """AdaDPS: rebuild the public ``A`` at the released ``x_t`` when its schedule says so."""
        if self.side_info:
            vector_to_parameters(self.params, self.model.parameters())
            if self.side_info.update(self.strategy.round, self.model):
                self.outputs.write_json("side_information.json", self.side_info.builds)


def build_server_app(cfg: RunConfig | None = None, resume: bool = False,
                     on_round: RoundCallback | None = None) -> ServerApp:
    """A ServerApp bound to ``cfg``, or reading it from Flower's run config when ``cfg`` is None;
    ``on_round`` as in :class:`DPFedAvgServer`."""
    app = ServerApp()

    @app.main()
    def main(grid: Grid, context: Context) -> None:
        if cfg is not None:
            run_cfg, run_resume = cfg, resume
        else:  # `flwr run`: the config comes from the run config, and nothing has prepared the data yet
            run_cfg, run_resume = config_from_context(context)
            ensure_data(run_cfg.data)
        server = DPFedAvgServer(run_cfg, load_task(run_cfg.data), on_round)
        server.run(grid, resume=run_resume)

    return app


app = build_server_app()
