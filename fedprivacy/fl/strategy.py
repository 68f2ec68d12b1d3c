r"""User-level DP strategies for any Flower 1.41 ``ServerApp``: DP-FedAvg(M), DP-FedAdam/Yogi/Adagrad,
DP-FedAdamBC and DP-MicroAdam on any model whose parameters travel as an ``ArrayRecord``.

.. code-block:: python

    strategy = DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=10, population=100)
    result = strategy.start(grid=grid, initial_arrays=ArrayRecord(model.state_dict()), num_rounds=50)
    strategy.epsilons()  # privacy spent so far, under RDP, PRV and PLD

Round ``t`` (McMahan et al. 2018, Alg. 1; ARCHITECTURE "One round, in order"):

1. **sample** over the FULL population (``population`` registered nodes; the run waits for them in
   round 1): Poisson with ``q = m / N`` or exactly ``m`` without replacement, accounted as exactly
   that (:class:`~fedprivacy.privacy.mechanism.GaussianMechanism`);
2. **broadcast** ``x_t``; each reply is either the client's full weights (Flower's convention: the
   strategy takes ``u_i = w_i - x_t`` against what it sent) or fedprivacy's sparse delta
   (``{"indices", "values"}``), one triage with fedprivacy's server (:func:`~fedprivacy.fl.records.reply_to_update`);
3. **clip** each ``u_i`` to C over ALL its float32 coordinates, **sum** unweighted, add **one**
   Gaussian draw ``N(0, z^2 C^2 I)``, divide by the EXPECTED cohort ``m``:
   ``g_t = (sum_i clip(u_i) + xi) / m``;
4. **then** :class:`~fedprivacy.optim.server_step.ServerStep` on ``g_t`` (post-processing, the
   same step as fedprivacy's server): DiSK's filter if ``disk_kappa`` is set, then the server
   optimizer (Flower's own DP wrappers add the noise AFTER the wrapped strategy's step, which
   breaks adaptive optimizers);
5. **account** the round; a ``target_epsilon`` stops the run before the round that would exceed it.

DiSK (Zhang et al. 2024, arXiv:2410.03883, Alg. 3; :mod:`fedprivacy.optim.disk`): from round 2 the
broadcast also carries ``"lookahead": x_t + gamma d_{t-1}`` and ``config["disk-c"] = c``; a client
that trains from both points with the same data order sends ``c Delta(lookahead) + (1 - c) Delta(x_t)``
(:func:`fedprivacy.optim.disk.disk_combination`); a client that ignores them sends ``Delta(x_t)`` and
the strategy still filters. Either way the filter is post-processing: epsilon is unchanged.

Record-level DP reported by the clients (e.g. Opacus inside the ClientApp,
:func:`fedprivacy.fl.record_dp.make_record_dp`): a reply's ``metrics``
``MetricRecord`` may carry the round's sample-level DP event in the contract of
:func:`fedprivacy.privacy.client_ledgers.event_metrics`; the strategy validates it (untrusted input),
composes it into that client's own ledger, and reports the largest client epsilon (at each client's own
delta, recomputed from the events: a reported ``epsilon`` is never used) as ``client_epsilon_max``
(:meth:`DPFedAvg.client_epsilons`). With ``record_level=True`` a reply without a valid event is
rejected as ``unaccounted``; otherwise such an event is ignored. Under ``local`` placement each upload
is a release of its own, composed likewise.

A reply the strategy cannot use (an error, other keys or shapes than the broadcast, another dtype,
NaN/Inf) counts as zero, changes neither the noise nor the divisor, and is logged as a WARNING
with its reason; the round's ``MetricRecord`` counts rejections by reason. A reply from a node that
was not sampled this round, or a second reply from one that was, is dropped with a WARNING (a node
never contributes twice: the sensitivity is one clipped update).

Crashes: with ``state_dir=PATH`` (:mod:`fedprivacy.fl.strategy_state`) the strategy logs every release
ahead and checkpoints after every round; a strategy constructed on a PATH that holds state continues
it: ``start()`` resumes from the checkpoint's round and model (the ``initial_arrays`` it is given are
then not used; ``Result.arrays`` is the final model, :attr:`DPFedAvg.arrays` the latest one), every
logged release is accounted, no cohort or noise draw is reused, and a changed setting (z, C, m, N,
sampling, placement, delta, seed, optimizer, ...) is refused naming it. ``num_rounds`` counts from the
start of the run, not of the restart. WITHOUT ``state_dir`` the ledger lives only in memory: a crash
loses it, and a restarted ServerApp would count its epsilon from zero.

Randomness (what a server that keeps the strategy's state can rebuild): by default (``seed=None``)
the cohort and the noise come from the OS's cryptographic source and nothing that rebuilds them is
kept; with ``seed=S`` (a reproducible simulation, logged as such) anyone who knows ``S`` rebuilds
every cohort and every noise draw, and with them the noise-free sums.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterable
from dataclasses import asdict
from pathlib import Path
from typing import Any

import numpy as np
import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedprivacy.fl.records import (arrays_to_record, arrays_to_vector, float32_arrays, reply_content, reply_to_update,
                                   vector_to_arrays)
from fedprivacy.optim.disk import DiskFilter
from fedprivacy.optim.factory import OptimizerName, make_server_optimizer
from fedprivacy.optim.server_step import ServerStep
from fedprivacy.privacy.accounting import AccountantKind, Sampling, resolve_delta
from fedprivacy.privacy.aggregation import RejectedUpdate, SparseUpdate
from fedprivacy.privacy.client_ledgers import ClientLedgers
from fedprivacy.privacy.mechanism import AdaptiveClipping, GaussianMechanism
from fedprivacy.fl.strategy_state import StrategyState
from fedprivacy.privacy.placement import Placement
from fedprivacy.privacy.release_log import ReleaseLog

log = logging.getLogger(__name__)


class DPFedAvg(Strategy):
    """User-level DP-FedAvg with any fedprivacy server optimizer (module docstring).

    Args:
        noise_multiplier: z (noise std on the sum in units of C).
        clip_norm: C (the initial C with ``adaptive_clipping``).
        expected_cohort: m, the expected (Poisson) or exact (fixed) cohort and the fixed divisor.
        population: N, the number of nodes sampling ranges over (all of them must register).
        sampling: ``"poisson"`` (add/remove-one) or ``"fixed"`` (replace-one).
        placement: ``central`` (this strategy clips and draws the noise), or ``distributed`` / ``local``
            (the clients clip and add their noise with :func:`fedprivacy.fl.mods.client_noise_mod`; the
            strategy sums the uploads as they are and tops up missing distributed shares).
        optimizer: ``sgd`` (DP-FedAvg; with ``momentum``, DP-FedAvgM), ``adam``, ``yogi``,
            ``adagrad``, ``adambc`` (Phi from the mechanism), ``microadam``.
        optimizer_settings: the optimizer's keyword settings (:func:`fedprivacy.optim.factory.make_server_optimizer`).
        adaptive_clipping: Andrew et al.'s quantile clip, or None.
        disk_kappa: DiSK's filter gain kappa in (0, 1] (1: the optimizer alone), or None for no DiSK.
        disk_gamma: DiSK's lookahead step gamma (non-zero).
        record_level: the clients train with record-level DP and must report its event (above).
        delta: the target delta in (0, 1) (default ``1 / population``; at least ``1 / population`` is
            logged as a WARNING: :func:`~fedprivacy.privacy.accounting.resolve_delta`).
        target_epsilon: stop before the round that would exceed it under ``budget_accountant``.
        accountants: the epsilons reported each round.
        seed: None (default, a deployment's): cohort and noise from the OS's cryptographic source; an int:
            a reproducible simulation whose cohorts and noise anyone knowing the seed can rebuild.
        node_timeout: seconds to wait in round 1 for ``population`` nodes to register.
        state_dir: a folder for the write-ahead release log and the checkpoint (module docstring,
            "Crashes"); None: nothing is kept, and a crash loses the ledger.
    """

    def __init__(self, *, noise_multiplier: float, clip_norm: float, expected_cohort: int, population: int,
                 sampling: Sampling = "poisson", placement: Placement = "central", optimizer: OptimizerName = "sgd",
                 lr: float = 1.0,
                 optimizer_settings: dict[str, Any] | None = None, adaptive_clipping: AdaptiveClipping | None = None,
                 disk_kappa: float | None = None, disk_gamma: float = 0.5,
                 record_level: bool = False, delta: float | None = None, target_epsilon: float | None = None,
                 budget_accountant: AccountantKind = "rdp", accountants: tuple[AccountantKind, ...] = ("rdp", "pld"),
                 seed: int | None = None, node_timeout: float = 600.0, state_dir: str | Path | None = None) -> None:
        self.settings = {"noise_multiplier": noise_multiplier, "clip_norm": clip_norm,
                         "expected_cohort": expected_cohort, "population": population, "sampling": sampling,
                         "placement": placement, "optimizer": optimizer, "lr": lr,
                         "optimizer_settings": dict(optimizer_settings or {}),
                         "adaptive_clipping": None if adaptive_clipping is None else asdict(adaptive_clipping),
                         "disk_kappa": disk_kappa, "disk_gamma": disk_gamma, "record_level": record_level,
                         "delta": delta, "seed": seed}
        """What a resumed run may not change (:meth:`fedprivacy.fl.strategy_state.StrategyState.load`)."""
        self.mechanism = GaussianMechanism(
            noise_multiplier=noise_multiplier, clip_norm=clip_norm, expected_cohort=expected_cohort,
            population=population, sampling=sampling, placement=placement, adaptive=adaptive_clipping, seed=seed)
        self.delta = resolve_delta(delta, population)
        if seed is not None:
            log.warning("DPFedAvg: SIMULATION: the cohorts and the noise are reproducible from seed=%d (anyone who "
                        "knows it rebuilds the noise-free sums); seed=None draws them from the OS", seed)
        settings = dict(optimizer_settings or {})
        if optimizer == "adambc":  # Phi from the mechanism; DiSK and C_t change it per round (ServerStep)
            settings.setdefault("phi", self.mechanism.phi())
        self.optimizer = make_server_optimizer(optimizer, lr=lr, **settings)
        self.step = ServerStep(self.optimizer, None if disk_kappa is None else DiskFilter(disk_kappa, disk_gamma))
        self.target_epsilon, self.budget_accountant = target_epsilon, budget_accountant
        self.accountants = list(accountants)
        self.node_timeout = node_timeout
        self.record_level = record_level
        self.client_ledgers = ClientLedgers()  # client-side releases (record-level DP, local noise), per node id
        self.stopped = False
        self._nodes: list[int] | None = None
        self._sent: dict[str, np.ndarray] | None = None
        self._cohort: set[int] = set()  # the nodes sampled this round: each may contribute once
        self.round = 0  # rounds completed, across restarts
        self._offset = 0  # rounds completed before this start(): Flower's loop counts from 1 again
        self.state = None if state_dir is None else StrategyState(state_dir)
        if self.state is not None:
            self.state.load(self.settings)  # a changed setting is refused now, before anything runs

    # -- Flower's Strategy interface ----------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start``; with ``state_dir``, resumable (module docstring, "Crashes")."""
        if self.state is None:
            return super().start(grid, initial_arrays, num_rounds, timeout, train_config, evaluate_config,
                                 evaluate_fn)
        with self.state.lock():
            saved = self.state.load(self.settings)
            if saved is not None:
                initial_arrays = self._restore(saved)
            lost = self.mechanism.attach_release_log(ReleaseLog(self.state.dir))
            if lost:
                log.warning("%d release(s) were made after the checkpoint (round %d) and are accounted; the round "
                            "after it runs again with a fresh cohort and draw", lost, self.round)
            self._offset = offset = self.round
            shifted = None if evaluate_fn is None else (lambda rnd, arrays: evaluate_fn(rnd + offset, arrays))
            result = super().start(grid, initial_arrays, max(num_rounds - offset, 0), timeout, train_config,
                                   evaluate_config, shifted)
        return _shift_rounds(result, offset, initial_arrays)

    @property
    def arrays(self) -> ArrayRecord | None:
        """The latest model (after the last completed round, or as restored from ``state_dir``), or None."""
        return None if self._sent is None else arrays_to_record(self._sent)

    def summary(self) -> None:
        m = self.mechanism
        log.info("DPFedAvg: z=%g, C=%g, m=%d of N=%d (%s sampling), delta=%.3g, server optimizer %s",
                 m.noise_multiplier, m.clip_norm, m.expected_cohort, m.population, m.sampling, self.delta,
                 type(self.optimizer).__name__)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample the cohort over the full population; broadcast ``arrays`` and ``config`` to it."""
        if self.stopped or (self.target_epsilon is not None and self.mechanism.would_exceed(
                self.delta, self.budget_accountant, self.target_epsilon)):
            if not self.stopped:
                log.warning("round %d: stopping, it would exceed epsilon %g", server_round, self.target_epsilon)
            self.stopped = True
            return []
        nodes = self._population(grid)
        self._sent = float32_arrays(arrays)
        t = self._offset + server_round
        round_config = ConfigRecord({**config, "server-round": t})
        content = RecordDict({"arrays": arrays, "config": round_config})
        lookahead = self.step.lookahead(arrays_to_vector(self._sent))
        if lookahead is not None and self.step.disk is not None:  # DiSK: x_t + gamma d_{t-1}, from released values
            content["lookahead"] = arrays_to_record(vector_to_arrays(lookahead, self._sent))
            round_config["disk-c"] = self.step.disk.c
        self._cohort = {nodes[i] for i in self.mechanism.sample()}
        return [Message(content, dst_node_id=node, message_type="train") for node in sorted(self._cohort)]

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """Clip, sum, ONE noise draw, fixed divisor, then :class:`ServerStep`: ``x_{t+1}``."""
        if self.stopped or self._sent is None:
            return None, None
        x, layout = arrays_to_vector(self._sent), {name: a.shape for name, a in self._sent.items()}
        agg, expected = self.mechanism.aggregator(x.numel()), set(self._cohort)
        for reply in replies:
            if reply.metadata.src_node_id not in expected:  # not sampled, or a second reply: never counts twice
                log.warning("round %d: ignoring a reply from node %s (not sampled this round, or already answered)",
                            server_round, reply.metadata.src_node_id)
                continue
            expected.discard(reply.metadata.src_node_id)
            try:
                update = self._accept(reply, x, layout)
            except RejectedUpdate as err:
                agg.reject(err.reason, f"node {reply.metadata.src_node_id}", str(err))
                continue
            agg.add_(update, f"node {reply.metadata.src_node_id}")
        for line in agg.stats.rejection_warnings():
            log.warning("round %d: %s", server_round, line)
        phi = self.mechanism.phi()
        self.round = self._offset + server_round
        g, _ = self.mechanism.release(agg, self.round)
        self.step.apply_(x, g, phi)
        self._sent = vector_to_arrays(x, self._sent)
        if self.state is not None:
            self.state.save(self.settings, {"round": self.round, "arrays": self._sent, **self._state_dict()})
        metrics = MetricRecord({**agg.stats.as_metrics(), **{f"epsilon_{k}": float("nan") if v is None else v
                                                            for k, v in self.epsilons().items()}})
        if len(self.client_ledgers):
            metrics["client_epsilon_max"] = max(self.client_epsilons().values())
        return arrays_to_record(self._sent), metrics

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No client-side evaluation (evaluate centrally with ``start(evaluate_fn=...)``)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    # -- privacy ------------------------------------------------------------------------------
    def epsilons(self) -> dict[str, float | None]:
        """Epsilon spent so far at ``delta`` under each of ``accountants``."""
        return self.mechanism.epsilons(self.delta, self.accountants)

    def client_epsilons(self, kind: AccountantKind | None = None) -> dict[int, float]:
        """Each client's (node id's) own epsilon from its client-side releases so far, at its own delta
        (else the run's), under ``kind`` (default ``budget_accountant``); empty if none reported any."""
        return self.client_ledgers.epsilons(self.delta, kind or self.budget_accountant)

    # -- internals ----------------------------------------------------------------------------
    def _state_dict(self) -> dict[str, Any]:
        return {"step": self.step.state_dict(), "mechanism": self.mechanism.state_dict(),
                "client_ledgers": self.client_ledgers.state_dict()}

    def _restore(self, saved: dict[str, Any]) -> ArrayRecord:
        """Continue from ``saved`` (:meth:`StrategyState.load`); returns the model to start from."""
        self.round = int(saved["round"])
        self.step.load_state_dict(saved["step"])
        self.mechanism.load_state_dict(saved["mechanism"])
        self.client_ledgers.load_state_dict(saved["client_ledgers"])
        self._sent = dict(saved["arrays"])
        log.info("DPFedAvg: resumed at round %d (%d releases accounted)", self.round, self.mechanism.ledger.rounds)
        return arrays_to_record(self._sent)

    def _population(self, grid: Grid) -> list[int]:
        """The population's node ids, fixed at round 1 once all ``population`` nodes are registered."""
        if self._nodes is None:
            deadline = time.monotonic() + self.node_timeout
            while len(ids := sorted(grid.get_node_ids())) < self.mechanism.population:
                if time.monotonic() > deadline:
                    raise TimeoutError(f"only {len(ids)} of population={self.mechanism.population} nodes "
                                       f"registered within {self.node_timeout:.0f} s")
                time.sleep(0.05)
            if len(ids) > self.mechanism.population:
                raise ValueError(f"{len(ids)} nodes registered but population={self.mechanism.population}: "
                                 "sampling must range over exactly the population the accountant assumes")
            self._nodes = ids
        return self._nodes

    def _accept(self, reply: Message, x: torch.Tensor, layout: dict[str, tuple[int, ...]]) -> SparseUpdate:
        """Account the client-side releases the reply reports, then its update: full weights minus the
        broadcast, or a sparse delta (:func:`~fedprivacy.fl.records.reply_to_update`); else RejectedUpdate."""
        content, m = reply_content(reply), self.mechanism
        try:
            self.client_ledgers.compose_reply(
                reply.metadata.src_node_id, content.metric_records.get("metrics"), record_level=self.record_level,
                local_noise_multiplier=m.noise_multiplier if m.placement == "local" else None)
        except ValueError as err:
            raise RejectedUpdate("unaccounted", str(err)) from None
        return reply_to_update(content, x, layout)


def _shift_rounds(result: Result, offset: int, initial_arrays: ArrayRecord) -> Result:
    """Flower's ``Result`` of a restarted loop with its rounds numbered from the run's start."""
    for history in (result.train_metrics_clientapp, result.evaluate_metrics_clientapp,
                    result.evaluate_metrics_serverapp):
        shifted = {rnd + offset: v for rnd, v in history.items()}
        history.clear()
        history.update(shifted)
    if not len(result.arrays):  # no round ran in this start(): the model is where the run left it
        result.arrays = initial_arrays
    return result
