"""fedprivacy's ServerApp: the :class:`~fedprivacy.fl.strategy.DPFedAvg` strategy built from a run's config,
with the run's hooks, started in the run's folder; as pfl-research keeps checkpointing and evaluation outside its
algorithms, what a run keeps around the round is hooks the strategy's one loop calls
(:meth:`DPFedAvg.start <fedprivacy.fl.strategy.DPFedAvg.start>`, :mod:`fedprivacy.fl.hooks`).

The round itself (budget check, sampling over the full population, broadcast, reply triage, clip and sum,
the release logged ahead with ONE noise draw and the fixed divisor, :class:`ServerStep`, accounting) and the loop
around it (resume, checkpoints every ``checkpoint_every`` rounds, the graceful stop) are the strategy's, the same
code a hand-written Flower ``ServerApp`` runs with it: both give bit-identical models and ledgers. What the run
adds (:class:`DPFedAvgServer`):

- the configuration: z calibrated from ``privacy.target_epsilon`` (``noise_multiplier: auto``), the
  strategy built from ``cfg`` (:func:`build_strategy`), the initial model from the run seed;
- its hooks (:mod:`fedprivacy.fl.run_hooks`): the population in partition order, AdaDPS's side information
  rebuilt at the released ``x_t`` when due, the canaries' grid, the in-process nodes' states, evaluation every
  ``eval_every`` rounds (Flower's ``evaluate_fn``), ``metrics.csv``, the ``tracking`` section's logs, the stop on
  SIGTERM; their states are saved in the strategy's ``checkpoint.pt`` (:mod:`fedprivacy.fl.strategy_state`);
- ``noise_mechanism.json``, the initial and final models, ``summary.json`` and ``client_privacy.csv``.

Flower's DP wrappers are NOT used: they add noise after the wrapped strategy's step.
"""

from __future__ import annotations

import json
import logging
import math
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fedprivacy.config import RunConfig
from fedprivacy.fl.config_parts import (accounting_of, aggregation_of_config, bounding_of, named_or_plugin,
                                        noise_of, noise_stream_of, participation_of, server_step_of)
from fedprivacy.fl.canaries import RunCanaries, population_with_canaries
from fedprivacy.fl.hooks import RunHook, StopOnRequest
from fedprivacy.fl.records import model_to_record
from fedprivacy.fl.run_config import config_from_context
from fedprivacy.fl.run_hooks import (Canaries, Evaluation, NodeStates, Population, RunRecords, SideInformationRefresh,
                                     Tracking)
from fedprivacy.fl.side_information import SideInformationBroadcast
from fedprivacy.fl.strategy import DPFedAvg, NodeContent
from fedprivacy.callbacks import RoundCallback
from fedprivacy.outputs import RunOutputs, noise_mechanism
from fedprivacy.privacy.accounting import PrivacyLedger, epsilon
from fedprivacy.privacy.calibration import calibrate_noise_multiplier, solve_noise_multiplier
from fedprivacy.privacy.mechanism import planned_ledger
from fedprivacy.privacy.noise import stream_name, torch_seed
from fedprivacy.stackoverflow_tasks import data_provenance, ensure_data, load_task
from fedprivacy.task import Task
from fedprivacy.tracking import open_tracker

log = logging.getLogger(__name__)

MODEL_INIT_STREAM = 0x696E6974  # "init": the initial model's random initialisation, per run seed


def build_strategy(cfg: RunConfig, population: int, model: torch.nn.Module, cls: type[DPFedAvg] = DPFedAvg,
                   node_content: NodeContent | None = None, state_dir: str | Path | None = None,
                   hooks: Sequence[RunHook] = ()) -> DPFedAvg:
    """The run's :class:`DPFedAvg` (a ``cls``) from ``cfg`` over ``population`` users training ``model``, built from
    its parts (:mod:`fedprivacy.fl.config_parts`); with ``state_dir`` and ``hooks`` (a checkpoint every
    ``cfg.checkpoint_every`` rounds), a run's; every accountant's epsilon at the evaluated rounds (every
    ``eval_every``-th and the last), the budget's at every round."""
    return cls(participation=participation_of(cfg, population), bounding=bounding_of(cfg), noise=noise_of(cfg),
               server_step=server_step_of(cfg, model), accounting=accounting_of(cfg),
               aggregation=aggregation_of_config(cfg), device=cfg.device, node_content=node_content,
               state_dir=state_dir, hooks=hooks, checkpoint_every=cfg.checkpoint_every,
               accountants_every=cfg.eval_every)


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
                                     sampling=named_or_plugin("privacy.sampling", p.sampling), groups=p.groups,
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
    """One run of ``cfg``: the strategy built from it with the run's hooks (:mod:`fedprivacy.fl.run_hooks`), its
    state folder the run's ``output_dir``; :meth:`run` starts its loop against a Flower ``Grid`` (module docstring).

    Args:
        cfg: the run's configuration.
        task: the data and model.
        on_round: called with ``(round, metrics row)`` after each round is recorded (e.g. a progress display).
        strategy_cls: the strategy's class (the audit's broken variants substitute theirs).
        resume: continue the run ``output_dir`` holds (else it must hold none).

    Raises:
        RunExistsError: the folder holds a run and ``resume`` is false.
        ResumeError: ``resume`` and nothing to resume, or a setting a resume may not change changed (naming it).
    """

    def __init__(self, cfg: RunConfig, task: Task, on_round: RoundCallback | None = None,
                 strategy_cls: type[DPFedAvg] = DPFedAvg, resume: bool = False) -> None:
        self.model = initial_model(task, cfg.seed, cfg.device)  # x_0 depends on the seed, not on z
        dim = sum(p.numel() for p in self.model.parameters())
        c = cfg.privacy.canaries  # canary clients: members of the population (fedprivacy.fl.canaries)
        self.canaries = RunCanaries(c, task.population, dim) if c is not None else None
        self.initial_params = parameters_to_vector(self.model.parameters()).detach().clone() if c else None
        self.population = population_with_canaries(cfg, task.population)
        self.cfg = cfg = resolve_noise_multiplier(cfg, self.population, dim)
        self.task, self.resume = task, resume
        self.outputs = RunOutputs(cfg)
        self.outputs.check(resume)
        self.side_info = SideInformationBroadcast(cfg, task) if cfg.client.adadps else None
        refresh = SideInformationRefresh(self.side_info, self.model, self.outputs) if self.side_info else None
        self.evaluation = Evaluation(cfg, task, self.model)
        self.tracking = Tracking(self.outputs)
        hooks: list[RunHook] = [RunRecords(cfg, self.outputs, on_round, refresh), self.evaluation]
        hooks += [refresh] if refresh else []
        hooks += [NodeStates(cfg.client.compression is not None)]
        hooks += [Canaries(self.canaries)] if self.canaries else []
        hooks += [Population(self.population), self.tracking, StopOnRequest()]
        self.strategy = build_strategy(cfg, self.population, self.model, strategy_cls, self.side_info,
                                       state_dir=cfg.output_dir, hooks=hooks)
        self.strategy.adopt(model_to_record(self.model))

    @property
    def params(self) -> torch.Tensor:
        """``x_t``, flat (the strategy's)."""
        assert self.strategy.params is not None
        return self.strategy.params

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

    def run(self, grid: Grid) -> dict[str, Any]:
        """Write the run's files, run the strategy's loop until ``cfg.rounds`` or the privacy budget (resuming
        from the folder's checkpoint with ``resume``), then the final model and the summary; return the summary.

        Raises:
            RunStopped: stopped on request between rounds (:mod:`fedprivacy.stopping`), its checkpoint written.
        """
        self.outputs.prepare(self.resume)
        m, p = self.strategy.mechanism, self.cfg.privacy
        self.outputs.write_json("noise_mechanism.json", noise_mechanism(
            stream_name(m.noise_stream), m.noise, noise_multiplier=m.noise_multiplier, clip_norm=p.clip_norm,
            sampling=p.sampling, groups=p.groups,
            placement="secure aggregation (Skellam)" if p.secure_aggregation else p.placement))
        log.info("privacy: %s", self.privacy_claim())
        if not self.resume:
            self.outputs.save_model("initial_model.pt", self._model_state())
        with open_tracker(self.outputs.dir, self.cfg.tracking, json.loads(self.cfg.to_json()),
                          self.cfg.privacy.placement, resume=self.resume) as self.tracking.tracker:
            self.strategy.start(grid, model_to_record(self.model), num_rounds=self.cfg.rounds,
                                timeout=self.cfg.round_timeout_s, evaluate_fn=self.evaluation)
            self.outputs.save_model("final_model.pt", self._model_state())
            summary = self._summary("privacy_budget" if self.strategy.stopped else "rounds")
            self.outputs.finish(summary)
        return summary

    def _summary(self, stop_reason: str) -> dict[str, Any]:
        """``summary.json``: how the run ended, its privacy claim, its last metrics; ``client_privacy.csv``."""
        s, p = self.strategy, self.cfg.privacy
        summary = {"rounds_completed": s.round, "stop_reason": stop_reason, "delta": s.delta,
                   "population": self.population, "engine": self.cfg.engine, "noise_multiplier": p.noise_multiplier,
                   "majority_baseline_accuracy": self.task.majority_baseline, "privacy_claim": self.privacy_claim(),
                   "releases": s.mechanism.ledger.rounds, "rounds_with_no_accepted_update": s.empty_rounds,
                   "data": data_provenance(self.cfg.data), **(self.outputs.rows[-1] if self.outputs.rows else {})}
        # a run the budget stopped after an unevaluated round: its last row has the budget's epsilon alone
        summary.update(s.epsilon_metrics(k for k in s.accountants if math.isnan(summary.get(f"epsilon_{k}", 0.0))))
        if self.side_info:
            summary["side_information"] = self.side_info.builds[-1]
        if self.canaries:
            assert self.initial_params is not None
            summary["empirical_epsilon"] = self.canaries.report(
                self.params - self.initial_params.to(self.params.device), s.mechanism, s.delta, p.budget_accountant,
                summary.get(f"epsilon_{p.budget_accountant}"))
        if len(s.client_ledgers):  # per-client guarantees: a file with every client, extremes in the summary
            s.client_ledgers.write_csv(self.outputs.dir / "client_privacy.csv", s.delta, list(p.accountants))
            summary.update(s.client_ledgers.summary(s.delta, p.budget_accountant))
        return summary

    def _model_state(self) -> dict[str, torch.Tensor]:
        vector_to_parameters(self.params, self.model.parameters())
        return self.model.state_dict()


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
        DPFedAvgServer(run_cfg, load_task(run_cfg.data), on_round, resume=run_resume).run(grid)

    return app


app = build_server_app()
