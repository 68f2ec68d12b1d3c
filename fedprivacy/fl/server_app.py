"""Flower ServerApp running DP-FedAvg: the round pipeline of ARCHITECTURE.md, in order.

Per round ``t``:

1. **budget check** (invariant 8): if composing this round's event would push the budget
   accountant's epsilon over ``privacy.target_epsilon``, stop BEFORE sampling;
2. **sample** the cohort over the FULL population (Poisson or fixed-size, invariant 5);
3. **broadcast** ``x_t`` (one ``ArrayRecord`` shared by every message of the round);
4. **aggregate** the replies as they stream in (fedprivacy's sparse deltas or Flower-style full
   weights, :func:`~fedprivacy.fl.records.reply_to_update`): flat L2 clip, unweighted sum; failed,
   missing, malformed or non-finite replies contribute zero (invariants 1, 2, 11, 12);
5. **privatize**: one dense Gaussian draw on the sum, divide by the EXPECTED cohort (invariant 3);
6. **server step** on the released ``g_t`` only (invariant 6), the one shared with the Flower strategy
   (:class:`~fedprivacy.optim.server_step.ServerStep`): optionally DiSK's filter first (its lookahead
   model is broadcast in step 3), then the server optimizer;
7. **account**: compose the round's event into the ledger; epsilon under every accountant;
8. **evaluate** every ``eval_every`` rounds, **checkpoint** every ``checkpoint_every`` rounds.

This module only moves messages and calls ``fedprivacy`` core objects; it holds no math.
Flower's DP wrappers are NOT used: they add noise after the wrapped strategy's step.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp
from torch.nn.utils import parameters_to_vector, vector_to_parameters

from fedprivacy.config import MicroAdamConfig, RunConfig
from fedprivacy.fl.records import record_nbytes, reply_content, reply_to_update, vector_to_record
from fedprivacy.fl.run_config import config_from_context
from fedprivacy.fl.side_information import VERSION as SIDE_INFO_VERSION
from fedprivacy.fl.side_information import SideInformationBroadcast
from fedprivacy.optim.disk import DiskFilter
from fedprivacy.optim.adambc import ServerAdamBC
from fedprivacy.optim.factory import ServerOptimizer, make_server_optimizer
from fedprivacy.optim.server_step import ServerStep
from fedprivacy.outputs import RunOutputs
from fedprivacy.privacy.accounting import resolve_delta
from fedprivacy.privacy.aggregation import PrivateSum, RejectedUpdate, SparseUpdate
from fedprivacy.privacy.calibration import calibrate_noise_multiplier
from fedprivacy.privacy.client_ledgers import ClientLedgers
from fedprivacy.privacy.mechanism import AdaptiveClipping, GaussianMechanism
from fedprivacy.privacy.noise import torch_seed
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.task import Task, data_provenance, ensure_data, load_task

log = logging.getLogger(__name__)

MODEL_INIT_STREAM = 0x696E6974  # "init": the initial model's random initialisation, per run seed
NODE_DISCOVERY_TIMEOUT_S = 600.0
REGISTRATION_SETTLE_S = 5.0
"""Once some SuperNodes are registered, how long their count may stay below the population before the
run fails (a mismatch is an immediate error, not a 600 s wait)."""


class PopulationMismatch(RuntimeError):
    """The number of registered SuperNodes differs from the data's number of users."""


def mismatch_message(nodes: int, population: int) -> str:
    """The one-line error for ``nodes`` registered SuperNodes and ``population`` users."""
    return (f"{nodes} SuperNodes registered but the data has {population} users: run with "
            f"--federation-config \"num-supernodes={population}\" or set --run-config \"num-users={nodes}\" "
            "(DP-FedAvg samples over, and accounts for, the whole population: one SuperNode per user)")


def discover_nodes(grid: Grid, population: int, timeout: float = NODE_DISCOVERY_TIMEOUT_S,
                   settle: float = REGISTRATION_SETTLE_S) -> list[int]:
    """Node id of each client index ``0..population-1``; waits until every node is registered.

    Sampling must range over the full population (invariant 5), so no round starts before all
    nodes answer a ``query`` with their ``partition-id``. More nodes than users, or a count that
    stays below the population for ``settle`` seconds once nodes have started to register, is a
    :class:`PopulationMismatch` right away; no node at all within ``timeout`` is a ``TimeoutError``.
    """
    deadline = time.monotonic() + timeout
    seen, changed = -1, time.monotonic()
    while len(node_ids := list(grid.get_node_ids())) != population:
        now = time.monotonic()
        if len(node_ids) != seen:
            seen, changed = len(node_ids), now
        if len(node_ids) > population or (node_ids and now - changed > settle):
            raise PopulationMismatch(mismatch_message(len(node_ids), population))
        if now > deadline:
            raise TimeoutError(f"only {len(node_ids)} of {population} nodes registered within {timeout:.0f}s")
        time.sleep(0.05)
    queries = [Message(RecordDict(), dst_node_id=n, message_type="query") for n in node_ids]
    by_partition: dict[int, int] = {}
    for reply in grid.send_and_receive(queries, timeout=timeout):
        if reply.has_error():
            raise RuntimeError(f"node {reply.metadata.src_node_id} failed the discovery query: {reply.error.reason}")
        by_partition[int(reply.content["node"]["partition-id"])] = reply.metadata.src_node_id
    missing = [p for p in range(population) if p not in by_partition]
    if missing:
        raise RuntimeError(f"{len(missing)} client partitions have no node (first: {missing[:5]})")
    return [by_partition[p] for p in range(population)]


def build_mechanism(cfg: RunConfig, population: int,
                    cls: type[GaussianMechanism] = GaussianMechanism) -> GaussianMechanism:
    """The run's user-level mechanism (a ``cls``) from ``cfg.privacy`` over ``population`` users."""
    p = cfg.privacy
    adaptive = (AdaptiveClipping(p.adaptive_clipping.target_quantile, p.adaptive_clipping.learning_rate,
                                 p.count_stddev) if p.adaptive_clipping else None)
    return cls(noise_multiplier=p.noise_multiplier, clip_norm=p.clip_norm,
                             expected_cohort=p.expected_cohort, population=population, sampling=p.sampling,
                             placement=p.placement, adaptive=adaptive, noise_cohort=p.noise_cohort,
                             noise_population=p.noise_population, seed=None if p.secure_noise else cfg.seed,
                             device=cfg.device)


def build_server_optimizer(cfg: RunConfig, dim: int, model: torch.nn.Module,
                           mechanism: GaussianMechanism) -> ServerOptimizer:
    """The configured server optimizer; DP-FedAdamBC's Phi is derived from the mechanism's noise."""
    s = cfg.server
    settings = {k: getattr(s, k) for k in s.explicit_settings()}
    if s.optimizer == "adambc":
        # Phi: the per-coordinate noise variance in g_t, (z C / M)^2 with M the (emulated) cohort
        # (notes/adambc.md §5.1), or as the noise placement makes it (local: z^2 C^2 / m). It changes
        # with C_t (adaptive clipping) and under DiSK: the server sets each round's (set_phi).
        settings["phi"] = mechanism.phi()
    if s.optimizer == "microadam":
        m = s.microadam or MicroAdamConfig()
        settings["microadam"] = {
            "density": m.density, "ring_size": m.ring_size, "bucket_size": m.bucket_size,
            "stochastic_rounding": m.stochastic_rounding, "seed": cfg.seed, "device": cfg.device,
            "per_tensor_sizes": [q.numel() for q in model.parameters()] if m.per_tensor else None,
        }
    return make_server_optimizer(s.optimizer, lr=s.lr, **settings)


def resolve_noise_multiplier(cfg: RunConfig, population: int) -> RunConfig:
    """``privacy.noise_multiplier: auto`` replaced by its calibrated value (any other config unchanged).

    z is :func:`~fedprivacy.privacy.calibration.calibrate_noise_multiplier` for ``target_epsilon``
    after ``rounds`` rounds of exactly the events this server will account (its sampling, the claim's
    population and cohort, ``delta`` or 1 / population, ``budget_accountant``), so the budget check
    never stops the run early and the final epsilon is within 1% below the target.
    """
    p = cfg.privacy
    if p.noise_multiplier != "auto":
        return cfg
    claim_population = p.noise_population or population
    z = calibrate_noise_multiplier(p.target_epsilon, p.delta if p.delta is not None else 1.0 / claim_population,
                                   sampling=p.sampling, population=claim_population,
                                   expected_cohort=float(p.accounting_cohort), rounds=cfg.rounds,
                                   accountant=p.budget_accountant)
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
    """Holds the server's state and runs the rounds against a Flower ``Grid``."""

    mechanism_cls: type[GaussianMechanism] = GaussianMechanism
    """The mechanism class (the audit's broken servers substitute a broken one)."""
    prefetch_noise = True
    """Start each round's noise draw (:meth:`PrivateSum.prefetch_noise`) as soon as the previous
    round's draws are made, so it runs on a second core during that round's tail and this round's
    clients; off only for servers that change the mechanism mid-round (the audit's broken variants)."""

    def __init__(self, cfg: RunConfig, task: Task,
                 on_round: Callable[[int, dict[str, float]], None] | None = None) -> None:
        """``on_round(round, metrics row)``, if given, is called after each round is recorded (e.g. a
        progress display)."""
        cfg = resolve_noise_multiplier(cfg, task.population)
        self.on_round = on_round
        self.cfg = cfg
        self.task = task
        p = cfg.privacy
        self.population = task.population
        # the population and cohort the privacy claim refers to (a deployment's, when emulating)
        self.claim_population = p.noise_population or self.population
        self.delta = resolve_delta(p.delta, self.claim_population, "privacy.delta")
        self.model = initial_model(task, cfg.seed, cfg.device)
        self.params = parameters_to_vector(self.model.parameters()).detach().clone()
        self.layout = {name: tuple(p.shape) for name, p in self.model.named_parameters()}  # of the broadcast
        self.mechanism = build_mechanism(cfg, self.population, self.mechanism_cls)
        self.optimizer = build_server_optimizer(cfg, self.params.numel(), self.model, self.mechanism)
        self.disk = DiskFilter(cfg.server.disk.kappa, cfg.server.disk.gamma) if cfg.server.disk else None
        self.step = ServerStep(self.optimizer, self.disk)  # everything after the release (shared with DPFedAvg)
        self.client_ledgers = ClientLedgers()  # client-side guarantees (local noise, sample-level DP), per client
        self.side_info = SideInformationBroadcast(cfg, task) if cfg.client.adadps else None
        self.round = 0
        self.empty_rounds: list[int] = []  # rounds in which no sampled client's update was accepted
        self.outputs = RunOutputs(cfg)
        self.grid: Grid | None = None

    # -- state ------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        return {
            "round": self.round,
            "params": self.params.cpu(),
            **self.step.state_dict(),  # optimizer, disk
            **self.mechanism.state_dict(),  # sampler, noise, ledger, adaptive_clip
            "client_ledgers": self.client_ledgers.state_dict(),
            "empty_rounds": list(self.empty_rounds),
            "side_information": self.side_info.state_dict() if self.side_info else None,
            # clients' own state where this engine holds it (in-process); real SuperNodes keep theirs
            "node_states": self.grid.node_state_dict() if hasattr(self.grid, "node_state_dict") else None,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.round = int(state["round"])
        self.params = state["params"].to(self.cfg.device)
        self.step.load_state_dict(state)
        self.mechanism.load_state_dict(state)
        self.client_ledgers.load_state_dict(state.get("client_ledgers") or {})  # absent before placements existed
        self.empty_rounds = list(state.get("empty_rounds", []))
        if self.side_info:
            self.side_info.load_state_dict(state["side_information"])

    def privacy_claim(self) -> str:
        """What the reported epsilon means, in words (written to the summary)."""
        p = self.cfg.privacy
        who = (f"a DEPLOYMENT with cohort {p.noise_cohort} of {self.claim_population} users (large-cohort "
               f"emulation: this simulation used cohort {p.expected_cohort} of {self.population} users with "
               f"noise scaled by {p.expected_cohort}/{p.noise_cohort}; the epsilon does NOT hold for the simulation)"
               if p.noise_cohort else f"this run: cohort {p.expected_cohort} of {self.population} users")
        where = {"central": "noise added by the server (trusted server)",
                 "distributed": "noise shares added by the clients (against the server: assumes secure "
                                "aggregation, and holds only in rounds whose server_noise_std top-up is 0)",
                 "local": "noise added by each client to its own upload (per-client local epsilon in "
                          "client_privacy.csv)"}[p.placement]
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
                self.delta >= 1 / self.claim_population else "")
        return (f"user-level ({p.sampling} sampling, delta={self.delta:.3g}{weak}) for {who}; {where}{records}{side}; "
                f"{randomness}{clients}")

    def _model_state(self) -> dict[str, torch.Tensor]:
        vector_to_parameters(self.params, self.model.parameters())
        return self.model.state_dict()

    def _downlink_bytes(self, with_lookahead: bool) -> int:
        """Bytes a client holding ``x_{t-1}`` needs for this round's broadcast: under DP-MicroAdam the
        sparse change ``x_t - x_{t-1}`` (int32 index + float32 value per coordinate), else the dense
        float32 model; plus DiSK's dense lookahead when one is sent."""
        sparse = getattr(self.optimizer, "downlink_bytes", None)
        model = sparse() if sparse is not None and self.round > 1 else 4 * self.params.numel()
        return model + (4 * self.params.numel() if with_lookahead else 0)

    # -- rounds -----------------------------------------------------------------------------
    def run(self, grid: Grid, resume: bool = False) -> dict[str, Any]:
        """Run rounds until ``cfg.rounds`` or the privacy budget; return the summary."""
        self.grid = grid
        checkpoint = self.outputs.prepare(resume)
        log.info("privacy: %s", self.privacy_claim())
        if checkpoint is not None:
            self.load_state_dict(checkpoint)
            log.info("resumed from round %d (epsilon so far kept in the ledger)", self.round)
            if checkpoint.get("node_states") and hasattr(grid, "load_node_state_dict"):
                grid.load_node_state_dict(checkpoint["node_states"])
            elif self.cfg.client.compression is not None:
                log.warning("this engine keeps no client state across a resume: uplink residuals restart at zero")
        else:
            self.outputs.save_model("initial_model.pt", self._model_state())
        lost = self.mechanism.attach_release_log(ReleaseLog(self.outputs.dir))
        if lost:
            log.warning("%d release(s) were made after the checkpoint (round %d) and are accounted in the ledger; "
                        "the rounds after it run again with fresh noise and cohorts (epoch %d)",
                        lost, self.round, self.mechanism.epoch)
        nodes = discover_nodes(grid, self.population)
        stop_reason = "rounds"
        while self.round < self.cfg.rounds:
            target = self.cfg.privacy.target_epsilon
            if target is not None and self.mechanism.would_exceed(self.delta, self.cfg.privacy.budget_accountant,
                                                                  target):
                stop_reason = "privacy_budget"
                log.info("stopping before round %d: it would exceed epsilon %.4g", self.round + 1, target)
                break
            self._run_round(grid, nodes)
        self.outputs.save_model("final_model.pt", self._model_state())
        self.outputs.save_checkpoint(self.state_dict())
        summary = {"rounds_completed": self.round, "stop_reason": stop_reason, "delta": self.delta,
                   "population": self.population, "engine": self.cfg.engine,
                   "noise_multiplier": self.cfg.privacy.noise_multiplier,
                   "majority_baseline_accuracy": self.task.majority_baseline,
                   "privacy_claim": self.privacy_claim(),
                   "releases": self.mechanism.ledger.rounds, "rounds_with_no_accepted_update": self.empty_rounds,
                   "data": data_provenance(self.cfg.data),
                   **{k: v for k, v in (self.outputs.rows[-1] if self.outputs.rows else {}).items()}}
        if self.side_info:
            summary["side_information"] = self.side_info.builds[-1]
        if len(self.client_ledgers):  # per-client guarantees: a file with every client, extremes in the summary
            p = self.cfg.privacy
            self.client_ledgers.write_csv(self.outputs.dir / "client_privacy.csv", self.delta, list(p.accountants))
            summary.update(self.client_ledgers.summary(self.delta, p.budget_accountant))
        self.outputs.finish(summary)
        return summary

    def post_process(self, g: torch.Tensor, phi: float) -> None:
        """Everything after the release, on ``g_t`` only (invariant 6): :class:`ServerStep` (DiSK's
        filter if configured, DP-FedAdamBC's Phi, the server optimizer); ``phi`` is this round's Phi_t."""
        self.step.apply_(self.params, g, phi)

    def _accept(self, reply: Message, partition: int) -> tuple[SparseUpdate, dict[str, float]]:
        """A reply's update (:func:`~fedprivacy.fl.records.reply_to_update`: a fedprivacy delta, or Flower-style
        full weights minus ``x_t``) and its numeric metrics, or :class:`RejectedUpdate` with the reason. Composes
        the client-side releases it reports (local noise, record-level DP) into that client's ledger first:
        a client that trained with record-level DP but reports no valid event is rejected."""
        content, p = reply_content(reply), self.cfg.privacy
        reported = content.metric_records.get("metrics") or {}
        try:
            self.client_ledgers.compose_reply(
                partition, reported, record_level=self.cfg.client.sample_dp is not None,
                local_noise_multiplier=p.noise_multiplier if p.placement == "local" else None)
        except ValueError as err:
            raise RejectedUpdate("unaccounted", str(err)) from None
        metrics = {k: float(v) for k, v in reported.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        return reply_to_update(content, self.params, self.layout), metrics

    def _run_round(self, grid: Grid, nodes: list[int]) -> None:
        """One round, top-down as in ARCHITECTURE.md: sample, broadcast, triage (clip and sum the replies
        as they stream in), release (logged ahead, ONE draw, fixed divisor, accounted), ServerStep, record."""
        t0 = time.perf_counter()
        self._refresh_side_information()
        self.round += 1
        cohort = self.mechanism.sample()
        clip_norm = self.mechanism.clip_norm  # C_t: the release moves it under adaptive clipping
        messages, downlink, side_info_bytes = self._broadcast(cohort, nodes, clip_norm)
        agg = self._aggregator()
        replies = self._collect(grid, messages, {nodes[i]: int(i) for i in cohort}, agg)
        self._report_rejections(agg, len(cohort))
        phi = self.mechanism.phi()
        g, unclipped = self.mechanism.release(agg, self.round)
        self.post_process(g, phi)
        if self.prefetch_noise and self.round < self.cfg.rounds:  # every draw of this round is made:
            self.mechanism.prefetch(agg)  # start the next round's, to overlap this round's tail and its clients
        row = self._metrics_row(agg, replies, clip_norm, unclipped)
        row.update(downlink_bytes_per_client=float(downlink), cohort_sampled=float(len(cohort)),
                   cohort_dropped=float(replies.dropped), seconds=time.perf_counter() - t0)
        if self.side_info:
            row["side_information_bytes"] = float(side_info_bytes)
        self._record(row)

    def _aggregator(self) -> PrivateSum:
        """The round's streaming clip-and-sum at C_t; its noise starts drawing now if not already."""
        agg = self.mechanism.aggregator(self.params.numel())
        if self.prefetch_noise:
            self.mechanism.prefetch(agg)  # round 1 or after a resume; else already drawing since the last round
        return agg

    def _record(self, row: dict[str, float]) -> None:
        """Write the round's metrics.csv row, checkpoint when due, and log one line."""
        self.outputs.log_round(row)
        if self.round % self.cfg.checkpoint_every == 0:
            self.outputs.save_checkpoint(self.state_dict())
        accountant = self.cfg.privacy.budget_accountant
        accuracy = row.get("test_accuracy", float("nan"))
        log.info("round %d: cohort %d, eps(%s) %.4g, %.2fs%s", self.round, int(row["cohort_sampled"]), accountant,
                 row[f"epsilon_{accountant}"], row["seconds"],
                 f", test accuracy {accuracy:.4f}" if accuracy == accuracy else "")
        if self.on_round is not None:
            self.on_round(self.round, row)

    def _refresh_side_information(self) -> None:
        """AdaDPS: rebuild the public ``A`` at the released ``x_t`` when its schedule says so."""
        if self.side_info:
            vector_to_parameters(self.params, self.model.parameters())
            if self.side_info.update(self.round, self.model):
                self.outputs.write_json("side_information.json", self.side_info.builds)

    def _broadcast(self, cohort, nodes: list[int], clip_norm: float) -> tuple[list[Message], int, int]:
        """The round's train messages (``x_t``, config, DiSK's lookahead, AdaDPS's A where due), the
        downlink bytes per client and the side information bytes of the round."""
        config: dict[str, Any] = {"server-round": self.round}
        if self.mechanism.epoch:  # a re-run of released rounds: simulated clients draw fresh noise streams too
            config["noise-epoch"] = self.mechanism.epoch
        content = {"arrays": vector_to_record(self.params, self.model)}
        lookahead = self.step.lookahead(self.params)
        if lookahead is not None:  # DiSK: x_t + gamma d_{t-1}, a function of released values only
            content["lookahead"] = vector_to_record(lookahead, self.model)
            config["disk-c"] = self.disk.c
        if self.cfg.client.compression is not None:  # clients clip what they send at this round's C
            config["clip-norm"] = clip_norm
        side_info_bytes = 0
        if self.side_info:
            config[SIDE_INFO_VERSION] = self.side_info.version
            side_info_bytes = sum(self.side_info.bytes_for(nodes[i]) for i in cohort)
        content["config"] = ConfigRecord(config)
        messages = [
            Message(RecordDict({**content, **(self.side_info.content_for(nodes[i]) if self.side_info else {})}),
                    dst_node_id=nodes[i], message_type="train", group_id=str(self.round))
            for i in cohort
        ]
        return messages, self._downlink_bytes(lookahead is not None), side_info_bytes

    def _collect(self, grid: Grid, messages: list[Message], partition_of: dict[int, int],
                 agg: PrivateSum) -> _Replies:
        """Stream the replies into ``agg`` (each one accepted, or rejected with its reason) and keep
        their diagnostics; a node that does not answer is a dropout."""
        expected, replies = set(partition_of), _Replies()
        for reply in grid.send_and_receive(messages, timeout=self.cfg.round_timeout_s):
            src = reply.metadata.src_node_id
            if src not in expected:  # a duplicate or unsolicited reply never counts twice
                log.warning("round %d: ignoring unexpected reply from node %s", self.round, src)
                continue
            expected.discard(src)
            if self.side_info:
                self.side_info.acknowledge(src, not reply.has_error())
            try:
                update, metrics = self._accept(reply, partition_of[src])
            except RejectedUpdate as err:
                agg.reject(err.reason, f"node {src}", str(err))
                continue
            if agg.add_(update, f"node {src}"):
                replies.uplink.append(record_nbytes(reply.content["arrays"]))
                if "train_loss" in metrics:
                    replies.losses.append(metrics["train_loss"])
                replies.residual_bytes.append(metrics.get("residual-bytes", 0.0))
        replies.dropped = len(expected)
        return replies

    def _report_rejections(self, agg: PrivateSum, sampled: int) -> None:
        """One warning per rejection reason; an error (and a flag in the summary) when nothing was accepted."""
        for line in agg.stats.rejection_warnings():
            log.warning("round %d: %s", self.round, line)
        if sampled and not agg.stats.accepted:
            self.empty_rounds.append(self.round)
            log.error("round %d: none of the %d sampled clients' updates was accepted; the release is noise alone",
                      self.round, sampled)

    def _metrics_row(self, agg: PrivateSum, replies: _Replies, clip_norm: float,
                     unclipped: float | None) -> dict[str, float]:
        """The round's metrics.csv row: losses, epsilons, evaluation when due, aggregation statistics."""
        p = self.cfg.privacy
        row: dict[str, float] = {"round": self.round, "train_loss": _mean(replies.losses, float("nan")),
                                 "test_loss": float("nan"), "test_accuracy": float("nan")}
        eps = self.mechanism.epsilons(self.delta, list(p.accountants))
        row.update({f"epsilon_{k}": (float("nan") if v is None else v) for k, v in eps.items()})
        if self.round % self.cfg.eval_every == 0 or self.round == self.cfg.rounds:
            vector_to_parameters(self.params, self.model.parameters())
            row.update(self.task.evaluate(self.model))
        row.update(agg.stats.as_metrics())
        row["clip_norm"] = clip_norm
        row["server_noise_std"] = agg.server_noise_std()
        if unclipped is not None:
            row["unclipped_fraction_released"] = unclipped
        if isinstance(self.optimizer, ServerAdamBC):  # where bias correction can matter (notes/adambc.md §7)
            row["adambc_floored_fraction"] = self.optimizer.floored_fraction
        row["uplink_bytes_per_client"] = _mean(replies.uplink, float("nan"))
        if self.cfg.client.compression is not None:
            row["residual_bytes_per_client"] = _mean(replies.residual_bytes, 0.0)
        return row


def _mean(values: list[float], empty: float) -> float:
    return sum(values) / len(values) if values else empty


@dataclass
class _Replies:
    """What a round's replies told the server besides their updates (diagnostics, not private)."""

    losses: list[float] = field(default_factory=list)
    uplink: list[int] = field(default_factory=list)
    residual_bytes: list[float] = field(default_factory=list)
    dropped: int = 0


def build_server_app(cfg: RunConfig | None = None, resume: bool = False,
                     on_round: Callable[[int, dict[str, float]], None] | None = None) -> ServerApp:
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
