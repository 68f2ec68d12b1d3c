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

Watching a run: ``on_round(round, metrics)`` (a :data:`~fedprivacy.callbacks.RoundCallback`, e.g.
:meth:`fedprivacy.tracking.RunTracker.log_round` for TensorBoard and MLflow) gets each round's metrics, the
``MetricRecord`` :meth:`DPFedAvg.aggregate_train` returns, as floats.

The loop: ``start()`` is Flower's ``Strategy.start`` contract (``configure_train``, the grid's replies into
``aggregate_train``, ``configure_evaluate``/``aggregate_evaluate``, ``evaluate_fn`` before the first round and after
each, a ``Result``) run by the strategy's own loop, which also stops between rounds (the budget; a hook's request:
:class:`~fedprivacy.fl.hooks.StopOnRequest` raises :class:`~fedprivacy.stopping.RunStopped` after a checkpoint),
checkpoints every ``checkpoint_every`` rounds and calls ``hooks`` (:class:`~fedprivacy.fl.hooks.RunHook`) at named
points: ``fedprivacy run`` is this loop with its hooks (:mod:`fedprivacy.fl.run_hooks`). It logs no line per round.

Crashes: with ``state_dir=PATH`` (:mod:`fedprivacy.fl.strategy_state`) the strategy logs every release
ahead and checkpoints every ``checkpoint_every`` rounds (with its hooks' states), at a stop and at the end; a
release after the last checkpoint stays accounted (the write-ahead log). A strategy constructed on a PATH that
holds state continues it: ``start()`` resumes from the checkpoint's round and model (the ``initial_arrays`` it is given are
then not used; ``Result.arrays`` is the final model, :attr:`DPFedAvg.arrays` the latest one), every
logged release is accounted, no cohort or noise draw is reused, and a changed setting (z, C, m, N,
sampling, placement, delta, seed, optimizer, ...) is refused naming it. ``num_rounds`` counts from the
start of the run, not of the restart. A cyclic schedule's users keep their places (their groups) by identity,
not node id (:meth:`DPFedAvg._population`): a restart with other users is refused naming them. WITHOUT ``state_dir`` the ledger lives only in memory: a crash
loses it, and a restarted ServerApp would count its epsilon from zero.

Randomness (what a server that keeps the strategy's state can rebuild): by default (``seed=None``)
the cohort and the noise come from the OS's cryptographic source and nothing that rebuilds them is
kept; with ``seed=S`` (a reproducible simulation, logged as such) anyone who knows ``S`` rebuilds
every cohort and every noise draw, and with them the noise-free sums.
"""

from __future__ import annotations

import logging
from contextlib import nullcontext
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, Protocol, Unpack, get_args

import torch
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid
from flwr.serverapp.strategy import Result, Strategy

from fedprivacy.checkpoints import ResumeError
from fedprivacy.fl.aggregation import Abort, Aggregation, Diagnostics, Released
from fedprivacy.fl.parts import Accounting, Bounding, Noise, Participation, ServerStepPart, StrategyKeywords, strategy_parts
from fedprivacy.privacy.combination import Combination, refuse_incompatible
from fedprivacy.fl.population import (NODE_DISCOVERY_TIMEOUT_S, PopulationMismatch, in_order, node_identities,
                                      population_change, wait_for_population)
from fedprivacy.fl.records import layout_to_record, record_to_layout, reply_content, reply_to_update, typed_record
from fedprivacy.fl.hooks import RunHook
from fedprivacy.fl.strategy_state import StrategyState
from fedprivacy.optim.server_step import ServerStep
from fedprivacy.callbacks import RoundCallback
from fedprivacy.privacy.accounting import AccountantKind, resolve_delta
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.updates import RejectedUpdate, SparseUpdate
from fedprivacy.privacy.client_ledgers import ClientLedgers
from fedprivacy.fl.secure_aggregation import SecureAggregation
from fedprivacy.privacy.mechanism import GaussianMechanism, Release
from fedprivacy.privacy.noise import stream_name
from fedprivacy.privacy.release_log import ReleaseLog
from fedprivacy.stopping import RunStopped

log = logging.getLogger(__name__)

class NodeContent(Protocol):
    """What a run adds to the train messages beyond the model, from public values only (AdaDPS's side
    information: :class:`fedprivacy.fl.side_information.SideInformationBroadcast`)."""

    def config(self) -> dict[str, int | float | str]:
        """Keys added to every train message's ``config`` this round."""

    def content_for(self, node: int) -> dict[str, ArrayRecord]:
        """Records added to ``node``'s train message this round."""

    def acknowledge(self, node: int, ok: bool) -> None:
        """``node`` answered this round's message (``ok``: without an error)."""


class DPFedAvg(Strategy):
    """User-level DP-FedAvg with any fedprivacy server optimizer (module docstring), built from its parts
    (:mod:`fedprivacy.fl.parts`): who participates, how contributions are bounded, what noise a release carries, how
    the uploads are summed, what the server does with the private average, and how it is accounted.

    The constructor takes the parts as objects (each states its own settings and mechanism arguments, so a new
    schedule, optimizer or aggregation needs no edit here), or the keyword form every release before the parts had,
    mapped onto them in one place (:func:`~fedprivacy.fl.parts.parts_from_keywords`) so that both build the same
    strategy, bit for bit, with the same :attr:`settings` (a checkpoint written by either resumes under the other)::

        DPFedAvg(participation=Participation(expected_cohort=10, population=100), bounding=Bounding(clip_norm=1.0),
                 noise=Noise(noise_multiplier=1.0))
        DPFedAvg(noise_multiplier=1.0, clip_norm=1.0, expected_cohort=10, population=100)  # the keyword form

    Args:
        participation: who takes part (:class:`~fedprivacy.fl.parts.Participation`).
        bounding: how each contribution is bounded (:class:`~fedprivacy.fl.parts.Bounding`).
        noise: what noise each release carries (:class:`~fedprivacy.fl.parts.Noise`).
        server_step: the optimizer and DiSK (:class:`~fedprivacy.fl.parts.ServerStepPart`; default SGD, lr 1).
        accounting: delta, budget, accountants (:class:`~fedprivacy.fl.parts.Accounting`; default delta 1 / N).
        aggregation: how the uploads become one release, an :class:`~fedprivacy.fl.aggregation.Aggregation`
            (default :class:`~fedprivacy.fl.aggregation.PlainAggregation`: the server clips, sums and the mechanism
            adds its noise; :class:`~fedprivacy.fl.aggregation.SecureAggregationPart`: SecAgg+).
        device: where the model, the sum and the noise live.
        node_content: what the train messages carry besides the model (:class:`NodeContent`), or None.
        node_timeout: seconds to wait in round 1 for ``population`` nodes to register.
        accountants_every: every accountant is computed at every this many rounds and at the last planned round;
            at the other rounds only ``budget_accountant``'s, the others' metrics NaN (PRV and PLD build a grid
            per call, about 0.05 s each at the quickstart's 40 rounds; what a round reports is exactly what the
            ledger gives, and the budget check is the same every round).
        state_dir: a folder for the write-ahead release log and the checkpoint (module docstring,
            "Crashes"); None: nothing is kept, and a crash loses the ledger.
        on_round: called with ``(round, metrics)`` after each round's release (module docstring, "Watching a run").
        hooks: what the loop calls around the rounds, in this order (:class:`~fedprivacy.fl.hooks.RunHook`); their
            states are saved with the strategy's and their ``fixed_settings`` refused changed like its settings.
        checkpoint_every: with ``state_dir``, checkpoint after every this many rounds (and at a stop, at the end).
        **keywords: the keyword form instead of the parts: ``noise_multiplier``, ``clip_norm``, ``expected_cohort``,
            ``population``, ``sampling``, ``placement``, ``optimizer``, ``lr``, ``optimizer_settings``,
            ``adaptive_clipping``, ``disk_kappa``, ``disk_gamma``, ``record_level``, ``delta``, ``target_epsilon``,
            ``budget_accountant``, ``accountants``, ``seed``, ``noise_cohort``, ``noise_population``,
            ``noise_stream``, ``groups`` (each the part's field of that name; ``noise_stream`` is ``Noise.stream``)
            and ``secure_aggregation`` (``aggregation=SecureAggregationPart(secure_aggregation)``).

    Raises:
        TypeError: both forms given, a part missing or of the wrong type (naming the parameter).
        ValueError: parts that cannot run together (:func:`~fedprivacy.privacy.combination.refuse_incompatible`).
        ResumeError: ``state_dir`` holds a run with other settings (naming them).
    """

    mechanism_cls: type[GaussianMechanism] = GaussianMechanism
    """The mechanism's class (the audit's deliberately broken strategies substitute a broken one)."""
    prefetch_noise = True
    """Start each release's draw (:meth:`PrivateSum.prefetch_noise`) as soon as the previous one is made,
    on a second core, during that round's tail and this round's clients (the same draw, bit for bit);
    off only for strategies that change the mechanism mid-round (the audit's broken variants)."""

    def __init__(self, *, participation: Participation | None = None, bounding: Bounding | None = None,
                 noise: Noise | None = None, server_step: ServerStepPart | None = None,
                 accounting: Accounting | None = None, aggregation: Aggregation | None = None,
                 device: str | torch.device = "cpu", node_content: NodeContent | None = None,
                 node_timeout: float = NODE_DISCOVERY_TIMEOUT_S, state_dir: str | Path | None = None,
                 on_round: RoundCallback | None = None, hooks: Sequence[RunHook] = (), checkpoint_every: int = 1,
                 accountants_every: int = 1, **keywords: Unpack[StrategyKeywords]) -> None:
        self.parts = parts = strategy_parts(participation, bounding, noise, server_step, accounting, aggregation,
                                            keywords)
        self.aggregation = parts.aggregation
        self.settings = parts.settings()
        """What a resumed run may not change (:meth:`fedprivacy.fl.strategy_state.StrategyState.load`)."""
        self.mechanism: GaussianMechanism = self.aggregation.mechanism(
            self.mechanism_cls, {**parts.mechanism_args(), "device": device})
        acc, disk = parts.accounting, parts.server_step.disk()
        self.delta = resolve_delta(acc.delta, self.mechanism.claim_population)
        _check_accounting(self.mechanism, acc.budget_accountant, acc.accountants, acc.target_epsilon)
        if parts.noise.seed is not None:
            log.warning("DPFedAvg: SIMULATION: the cohorts and the noise are reproducible from seed=%d (anyone who "
                        "knows it rebuilds the noise-free sums); seed=None draws them from the OS", parts.noise.seed)
        self.optimizer = parts.server_step.build_optimizer(self.mechanism.phi())
        refuse_incompatible([self.aggregation, disk, self.optimizer], Combination(
            record_level=parts.bounding.record_level, disk=disk is not None,
            noise_stream=stream_name(parts.noise.stream),
            independent_noise=getattr(self.mechanism.noise, "independent", True)))
        self.step = ServerStep(self.optimizer, disk)
        self.target_epsilon, self.budget_accountant = acc.target_epsilon, acc.budget_accountant
        self.accountants = list(acc.accountants)
        if accountants_every < 1:
            raise ValueError(f"accountants_every must be >= 1, got {accountants_every!r}")
        self.accountants_every = accountants_every
        self.record_level, self.device = parts.bounding.record_level, torch.device(device)
        self.node_content, self.node_timeout, self.on_round = node_content, node_timeout, on_round
        self._start_empty()
        if checkpoint_every < 1:
            raise ValueError(f"checkpoint_every must be >= 1, got {checkpoint_every!r}")
        self.hooks, self.checkpoint_every = list(hooks), checkpoint_every
        self.state = None if state_dir is None else StrategyState(state_dir)
        if self.state is not None:
            self.state.load(self.fixed_settings(), self.former_settings)  # refused now, before anything runs

    @property
    def secure_aggregation(self) -> SecureAggregation | None:
        """SecAgg+'s parameters when the uploads are summed under secure aggregation, else None."""
        config = getattr(self.aggregation, "config", None)
        return config if isinstance(config, SecureAggregation) else None

    def _start_empty(self) -> None:
        """No model, population, cohort or round yet (:meth:`adopt`, :meth:`_population`, :meth:`resume`)."""
        self.client_ledgers = ClientLedgers()  # client-side releases (record-level DP, local noise), per client
        self.params: torch.Tensor | None = None  # x_t, flat, on ``device``
        self.layout: dict[str, tuple[int, ...]] = {}  # parameter name -> shape, in the broadcast's order
        self._record: ArrayRecord | None = None  # x_t as broadcast (and returned by aggregate_train)
        self.nodes: list[int] | None = None  # the population's node ids, in sampling order
        self.identities: list[int] | None = None  # a cyclic schedule's users by identity, in sampling order (kept)
        self._unordered = False  # resumed from a state that kept no order of its users
        self._labels: dict[int, int] = {}  # node id -> the id its client-side ledger is kept under
        self.cohort: list[int] = []  # this round's sampled nodes
        self._waiting: set[int] = set()  # sampled nodes that have not answered: each may contribute once
        self._downlink = 0
        self.round = 0  # rounds completed, across restarts
        self._offset = 0  # rounds completed before this start(): Flower's loop counts from 1 again
        self.rounds_planned: int | None = None  # the run's last round, when known (no draw is prefetched past it)
        self.empty_rounds: list[int] = []  # rounds in which no sampled client's update was accepted
        self.stopped = False

    # -- Flower's Strategy interface ----------------------------------------------------------
    def start(self, grid: Grid, initial_arrays: ArrayRecord, num_rounds: int = 3, timeout: float | None = 3600,
              train_config: ConfigRecord | None = None, evaluate_config: ConfigRecord | None = None,
              evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None = None) -> Result:
        """Flower's ``Strategy.start``, run by the strategy's own loop (module docstring, "The loop"): rounds until
        ``num_rounds`` (counted from the run's start) or the budget; with ``state_dir``, resumable (module docstring,
        "Crashes"). ``evaluate_fn(round, arrays)`` runs before the first round of this start and after each round,
        as in Flower's loop.

        Raises:
            RunStopped: a hook asked to stop (:class:`~fedprivacy.fl.hooks.StopOnRequest`); the checkpoint is written.
        """
        self.rounds_planned = num_rounds
        train_config = ConfigRecord() if train_config is None else train_config
        evaluate_config = ConfigRecord() if evaluate_config is None else evaluate_config
        result = Result()
        self.summary()
        with self.state.lock() if self.state is not None else nullcontext():
            self.adopt(initial_arrays)
            if self.state is not None:
                saved = self.state.load(self.fixed_settings(), self.former_settings)
                for hook in self.hooks:
                    if saved is not None:
                        hook.load_state_dict(saved)
                self.resume(saved, ReleaseLog(self.state.dir))
            self._offset = self.round
            for hook in self.hooks:
                grid = hook.start(self, grid)
            if evaluate_fn is not None:
                _evaluate(result, evaluate_fn, self.round, self._record)
            while self.round < num_rounds and self._round(grid, timeout, train_config, evaluate_config, evaluate_fn,
                                                          result):
                if self.round < num_rounds and any(hook.stop_requested() for hook in self.hooks):
                    self.checkpoint()
                    raise RunStopped(f"stopped on request after round {self.round}; its checkpoint holds every "
                                     "release: resuming continues with nothing lost")
            self.checkpoint()
        if not len(result.arrays):  # no round ran in this start(): the model is where the run left it
            assert self._record is not None
            result.arrays = self._record
        return result

    def _round(self, grid: Grid, timeout: float | None, train_config: ConfigRecord, evaluate_config: ConfigRecord,
               evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None] | None, result: Result) -> bool:
        """Round ``round + 1`` of the loop (Flower's ``server_round`` counts from 1 at each start): the hooks'
        ``before_round``, :meth:`configure_train`, the replies into :meth:`aggregate_train`, client-side and
        central evaluation, the hooks' ``after_round``, a checkpoint when due. False if the budget stopped the run."""
        t, k = self.round + 1, self.round + 1 - self._offset
        assert self._record is not None, "adopt() the initial model first"
        for hook in self.hooks:
            hook.before_round(t)
        messages = list(self.configure_train(k, self._record, train_config, grid))
        if self.stopped:
            return False
        for hook in self.hooks:
            hook.sampled(t, self.cohort)
        arrays, metrics = self.aggregate_train(k, grid.send_and_receive(messages, timeout=timeout))
        if arrays is not None:
            result.arrays = arrays
        if metrics is not None:
            result.train_metrics_clientapp[self.round] = metrics
        row = {key: float(v) for key, v in (metrics or {}).items()}  # type: ignore[arg-type]
        evaluation = list(self.configure_evaluate(k, self._record, evaluate_config, grid))
        if evaluation:
            client_metrics = self.aggregate_evaluate(k, grid.send_and_receive(evaluation, timeout=timeout))
            if client_metrics is not None:
                result.evaluate_metrics_clientapp[self.round] = client_metrics
        if evaluate_fn is not None:
            row.update(_evaluate(result, evaluate_fn, self.round, self._record))
        for hook in self.hooks:
            hook.after_round(self.round, row)
        if self.round % self.checkpoint_every == 0:
            self.checkpoint()
        return True

    def fixed_settings(self) -> dict[str, Any]:
        """What a resume may not change: :attr:`settings` and every hook's ``fixed_settings``."""
        out = dict(self.settings)
        for hook in self.hooks:
            out.update(hook.fixed_settings())
        return out

    def former_settings(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """The fixed settings of a state written before they were saved, as its hooks tell them (their
        ``former_settings``; a hook that cannot tell keeps its current ones, as does the strategy); None when no
        hook can tell (:func:`~fedprivacy.fl.strategy_state.migrate`)."""
        told = [hook.former_settings(state) for hook in self.hooks]
        if all(t is None for t in told):
            return None
        out = dict(self.settings)
        for hook, t in zip(self.hooks, told):
            out.update(hook.fixed_settings() if t is None else t)
        return out

    def checkpoint(self) -> None:
        """With ``state_dir``: save :meth:`state_dict` and the hooks' states, then tell the hooks (their
        ``checkpointed``); nothing without."""
        if self.state is None:
            return
        state = self.state_dict()
        for hook in self.hooks:
            state.update(hook.state_dict())
        self.state.save(self.fixed_settings(), state)
        for hook in self.hooks:
            hook.checkpointed()

    @property
    def arrays(self) -> ArrayRecord | None:
        """The latest model (after the last completed round, or as restored from ``state_dir``), or None."""
        return self._record

    def summary(self) -> None:
        m = self.mechanism
        log.info("DPFedAvg: z=%g, C=%g, m=%d of N=%d (%s sampling), delta=%.3g, server optimizer %s",
                 m.noise_multiplier, m.clip_norm, m.expected_cohort, m.population, m.sampling, self.delta,
                 type(self.optimizer).__name__)

    def configure_train(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                        grid: Grid) -> Iterable[Message]:
        """Sample the cohort over the full population; broadcast ``x_t`` (``arrays``), ``config``, C_t,
        DiSK's lookahead and the node content to it; nothing once the budget would be exceeded."""
        self.adopt(arrays)
        if self._out_of_budget(self._offset + server_round):
            return []
        nodes = self._population(grid)
        t = self._offset + server_round
        self.cohort = [nodes[i] for i in self.mechanism.sample()]
        self._waiting = set(self.cohort)
        content = self._broadcast(t, config)
        return [self._train_message(t, node_content, node)
                for node, node_content in self.aggregation.messages_for(self, grid, t, self.cohort, content)]

    def _train_message(self, t: int, content: Mapping[str, ArrayRecord | ConfigRecord], node: int) -> Message:
        extra = self.node_content.content_for(node) if self.node_content is not None else {}
        return Message(RecordDict({**content, **extra}), dst_node_id=node, message_type="train", group_id=str(t))

    def aggregate_train(self, server_round: int,
                        replies: Iterable[Message]) -> tuple[ArrayRecord | None, MetricRecord | None]:
        """The aggregation part's release of the replies (:meth:`Aggregation.release
        <fedprivacy.fl.aggregation.Aggregation.release>`: e.g. clip and sum them as they stream in, ONE noise draw,
        fixed divisor; logged ahead and accounted), then :meth:`post_process`: ``x_{t+1}`` and the round's metrics;
        a round the part aborts leaves the model as it was."""
        if self.stopped or self.params is None:
            return None, None
        self.round = self._offset + server_round
        outcome = self.aggregation.release(self, self.round, replies)
        if isinstance(outcome, Abort):
            arrays, metrics = self._record, MetricRecord({**self._epsilon_metrics(), **outcome.metrics})
        else:
            arrays, metrics = self._finish(outcome)
        if self.on_round is not None:
            self.on_round(self.round, {k: float(v) for k, v in metrics.items()})  # type: ignore[arg-type]
        return arrays, metrics

    def _finish(self, outcome: Released) -> tuple[ArrayRecord, MetricRecord]:
        """After the release: :meth:`post_process`, the next draw's prefetch, the checkpoint, the round's metrics."""
        assert self.params is not None
        agg, released = outcome.agg, outcome.release
        self.post_process(released.g, released.phi)
        self._record = layout_to_record(self.params, self.layout)
        if self.prefetch_noise and (self.rounds_planned is None or self.round < self.rounds_planned):
            self.mechanism.prefetch(agg)  # every draw of this round is made: start the next round's
        metrics: dict[str, Any] = {**outcome.diagnostics.metrics(), **self._privacy_metrics(agg, released),
                                   **self.round_metrics(), **outcome.metrics}
        return self._record, MetricRecord(metrics)

    def round_metrics(self) -> dict[str, float]:
        """The round's downlink bytes per client, sampled cohort and sampled nodes that did not answer."""
        return {"downlink_bytes_per_client": float(self._downlink), "cohort_sampled": float(len(self.cohort)),
                "cohort_dropped": float(len(self._waiting))}

    def configure_evaluate(self, server_round: int, arrays: ArrayRecord, config: ConfigRecord,
                           grid: Grid) -> Iterable[Message]:
        """No client-side evaluation (evaluate centrally with ``start(evaluate_fn=...)``)."""
        return []

    def aggregate_evaluate(self, server_round: int, replies: Iterable[Message]) -> MetricRecord | None:
        return None

    # -- seams --------------------------------------------------------------------------------
    def post_process(self, g: torch.Tensor, phi: float) -> None:
        """Everything after the release, on ``g_t`` only (invariant 6): :class:`ServerStep` (DiSK's filter
        if configured, DP-FedAdamBC's Phi, the server optimizer); ``phi`` is this round's Phi_t."""
        assert self.params is not None
        self.step.apply_(self.params, g, phi)

    def adopt(self, arrays: ArrayRecord) -> None:
        """Take ``arrays`` as ``x_t`` (float32 only), unless it is the model this strategy last returned
        (Flower's loop hands that back each round: no copy is made then)."""
        if arrays is not self._record:
            self.params, self.layout = record_to_layout(arrays, self.device)
            self._record = arrays
            self.aggregation.adopt(self.mechanism, self.params.numel())

    def use_population(self, nodes: Sequence[int], labels: Sequence[int] | None = None) -> None:
        """Sample over ``nodes`` (in this order) instead of the registered nodes in the strategy's own order
        (:meth:`_population`); ``labels``: each node's identity (its partition-id), under which its client-side
        releases are kept (default: its node id). A cyclic schedule keeps the order of these identities: resumed
        from a state that holds one, it takes ``nodes`` in the saved order (:meth:`_arrange`); from a state
        that holds none, in the order given (the partition order fedprivacy's run has always used)."""
        if len(nodes) != self.mechanism.population:
            raise ValueError(f"{len(nodes)} nodes given for population={self.mechanism.population}")
        self._labels = dict(zip(nodes, labels)) if labels is not None else {}
        if labels is not None and self.mechanism.sampler.separation is not None:
            self._arrange(self._labels, list(labels))
        elif self.identities is not None and self.mechanism.sampler.separation is not None:
            raise ValueError("use_population: the saved state orders the users by identity: give each node's "
                             "partition-id as labels=...")
        else:
            self.nodes = list(nodes)

    def resume(self, saved: dict[str, Any] | None, release_log: ReleaseLog) -> int:
        """Continue from ``saved`` (:meth:`state_dict`; None: from round 0) with every release in
        ``release_log`` accounted; from now on the log records each release before its noise is drawn.
        Returns how many logged releases the checkpoint did not hold (their rounds run again, with a
        fresh cohort and draw)."""
        if saved is not None:
            self.load_state_dict(saved)
        lost = self.mechanism.attach_release_log(release_log)
        if lost:
            log.warning("%d release(s) were made after the checkpoint (round %d) and are accounted; the rounds "
                        "after it run again with a fresh cohort and draw (noise epoch %d)",
                        lost, self.round, self.mechanism.epoch)
        self._offset = self.round
        return lost

    # -- privacy ------------------------------------------------------------------------------
    def epsilons(self) -> dict[str, float | None]:
        """Epsilon spent so far at ``delta`` under each of ``accountants``."""
        return self.mechanism.epsilons(self.delta, self.accountants)

    def client_epsilons(self, kind: AccountantKind | None = None) -> dict[int, float]:
        """Each client's own epsilon from its client-side releases so far, at its own delta (else the
        run's), under ``kind`` (default ``budget_accountant``); empty if none reported any."""
        return self.client_ledgers.epsilons(self.delta, kind or self.budget_accountant)

    # -- state --------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The round, ``x_t``, the server step's and the mechanism's state, the clients' ledgers."""
        return {"round": self.round, "params": None if self.params is None else self.params.cpu(),
                **self.step.state_dict(), **self.mechanism.state_dict(),
                "client_ledgers": self.client_ledgers.state_dict(), "empty_rounds": list(self.empty_rounds),
                "identities": self.identities}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` onto a strategy holding a model of the same layout (:meth:`adopt`)."""
        params = state["params"]
        if self.params is None or params.numel() != self.params.numel():
            raise ResumeError(f"the saved model has {params.numel()} values; the model given has "
                              f"{None if self.params is None else self.params.numel()}")
        self.round = int(state["round"])
        self.params = params.to(self.device)
        self.step.load_state_dict(state)
        self.mechanism.load_state_dict(state)
        self.client_ledgers.load_state_dict(state.get("client_ledgers") or {})
        self.empty_rounds = list(state.get("empty_rounds", []))
        self.identities = state.get("identities")
        self._unordered = self.identities is None
        self._record = layout_to_record(self.params, self.layout)
        log.info("DPFedAvg: resumed at round %d (%d releases accounted)", self.round, self.mechanism.ledger.rounds)

    # -- internals ----------------------------------------------------------------------------
    def _out_of_budget(self, t: int) -> bool:
        """Whether the run has stopped: round ``t``'s release would exceed ``target_epsilon`` (invariant 8)."""
        if not self.stopped and self.target_epsilon is not None and self.mechanism.would_exceed(
                self.delta, self.budget_accountant, self.target_epsilon):
            log.warning("stopping before round %d: it would exceed epsilon %g", t, self.target_epsilon)
            self.stopped = True
        return self.stopped

    def _population(self, grid: Grid) -> list[int]:
        """The population's node ids in sampling order, fixed at round 1
        (:func:`~fedprivacy.fl.population.wait_for_population`). Poisson and fixed-size sampling treat every user
        alike each round: the nodes' sorted ids. A cyclic schedule puts user ``i`` in group ``i mod b``: when its
        order outlives this start (``state_dir``, or a state loaded), the nodes report their identities
        (:func:`~fedprivacy.fl.population.node_identities`) and each keeps its place across restarts
        (:meth:`_arrange`), whatever node id it registers under."""
        if self.nodes is None:
            nodes = wait_for_population(grid, self.mechanism.population, self.node_timeout)
            kept = self.state is not None or self.identities is not None or self._unordered
            if self.mechanism.sampler.separation is None or not kept:
                self.nodes = nodes
                return self.nodes
            if self._unordered:
                raise ResumeError(f"resume refused: the saved state keeps no order of its users (written by an older "
                                  f"fedprivacy, by a strategy without state_dir, or given its population without "
                                  f"identities): under other node ids the {self.mechanism.sampling} schedule's groups "
                                  f"could change and a user participate less than {self.mechanism.sampler.separation} "
                                  f"releases apart (start the run anew in another state_dir)")
            identities = node_identities(grid, nodes, self.node_timeout)
            self._labels = dict(identities)
            self._arrange(identities, sorted(identities.values()))
        assert self.nodes is not None
        return self.nodes

    def _arrange(self, identities: Mapping[int, int], fresh: list[int]) -> None:
        """Sample over the nodes (node id -> identity) in the saved order of identities, or in ``fresh``'s on a
        run's first start; a population that is not exactly the saved one (a missing, new or duplicated
        identity) is refused naming them: it would move users between the cyclic schedule's groups."""
        order = fresh if self.identities is None else self.identities
        if (change := population_change(identities, order)) is not None:
            if self.identities is None:
                raise PopulationMismatch(f"the {self.mechanism.sampling} schedule needs one node per user: {change}")
            raise ResumeError(f"resume refused: {change}: the {self.mechanism.sampling} schedule's groups would "
                              f"change (start the same users, each with its partition-id, or use another state_dir)")
        self.nodes = in_order(identities, order)
        self.identities = list(order)

    def _broadcast(self, t: int, config: ConfigRecord) -> dict[str, ArrayRecord | ConfigRecord]:
        """What every sampled node receives in round ``t``: ``x_t``, the config (with the round, C_t, the
        noise epoch after a re-run of released rounds) and what the server step's parts add
        (:meth:`ServerStep.broadcast <fedprivacy.optim.server_step.ServerStep.broadcast>`: DiSK's lookahead
        ``x_t + gamma d_{t-1}`` and ``c``), functions of released values only."""
        assert self.params is not None and self._record is not None
        round_config = ConfigRecord({**config, "server-round": t, "clip-norm": float(self.mechanism.clip_norm)})
        if self.mechanism.epoch:  # simulated clients draw fresh noise streams too
            round_config["noise-epoch"] = self.mechanism.epoch
        if self.node_content is not None:
            round_config.update(self.node_content.config())
        content: dict[str, ArrayRecord | ConfigRecord] = {"arrays": self._record, "config": round_config}
        extra = self.step.broadcast(self.params)
        if taken := sorted(set(extra.arrays) & set(content)):
            raise ValueError(f"the server step adds {taken[0]!r} to the broadcast, a record the strategy sends")
        content.update((name, layout_to_record(array, self.layout)) for name, array in extra.arrays.items())
        round_config.update(extra.config)
        self._downlink = self.step.downlink_bytes(self.params, t, extra)
        return content

    def aggregator(self) -> PrivateSum:
        """The round's sum from the mechanism (:meth:`~fedprivacy.privacy.mechanism.GaussianMechanism.aggregator`:
        the streaming clip-and-sum at C_t); its noise starts drawing now if not already."""
        assert self.params is not None
        agg = self.mechanism.aggregator(self.params.numel())
        if self.prefetch_noise:
            self.mechanism.prefetch(agg)  # round 1 or after a resume; else already drawing since the last round
        return agg

    def collect(self, t: int, replies: Iterable[Message], agg: PrivateSum) -> Diagnostics:
        """Stream the replies into ``agg``, each accepted or rejected with its reason; a reply from a node
        not sampled this round, or a second one, is dropped (a node never contributes twice)."""
        diagnostics = Diagnostics()
        for node, reply in self.answers(t, replies):
            if self.node_content is not None:
                self.node_content.acknowledge(node, not reply.has_error())
            try:
                update = self._accept(reply)
            except RejectedUpdate as err:
                agg.reject(err.reason, f"node {node}", str(err))
                continue
            if agg.add_(update, f"node {node}"):
                diagnostics.add(reply.content)
        return diagnostics

    def answers(self, t: int, replies: Iterable[Message]) -> Iterator[tuple[int, Message]]:
        """``(node, reply)`` for each reply of a node sampled this round that has not answered yet; any other reply
        is dropped with a WARNING (a node never contributes twice)."""
        for reply in replies:
            node = reply.metadata.src_node_id
            if node not in self._waiting:
                log.warning("round %d: ignoring a reply from node %s (not sampled this round, or already answered)",
                            t, node)
                continue
            self._waiting.discard(node)
            yield node, reply

    def _accept(self, reply: Message) -> SparseUpdate:
        """Account the client-side releases the reply reports, then its update: full weights minus the
        broadcast, or a sparse delta (:func:`~fedprivacy.fl.records.reply_to_update`); else RejectedUpdate."""
        assert self.params is not None
        content, m, node = reply_content(reply), self.mechanism, reply.metadata.src_node_id
        try:
            self.client_ledgers.compose_reply(
                self._labels.get(node, node), typed_record(content, "metrics", MetricRecord), record_level=self.record_level,
                local_noise_multiplier=m.noise_multiplier if m.placement == "local" else None)
        except ValueError as err:
            raise RejectedUpdate("unaccounted", str(err)) from None
        return reply_to_update(content, self.params, self.layout)

    def report_rejections(self, agg: PrivateSum) -> None:
        """One warning per rejection reason; an error (and a record in ``empty_rounds``) when nothing was accepted."""
        for line in agg.stats.rejection_warnings():
            log.warning("round %d: %s", self.round, line)
        if self.cohort and not agg.stats.accepted:
            self.empty_rounds.append(self.round)
            log.error("round %d: none of the %d sampled clients' updates was accepted; the release is noise alone",
                      self.round, len(self.cohort))

    def epsilon_metrics(self, kinds: Iterable[AccountantKind]) -> dict[str, float]:
        """``epsilon_<kind>`` so far for each of ``kinds`` (NaN where one cannot account the ledger)."""
        return {f"epsilon_{k}": float("nan") if v is None else v
                for k, v in self.mechanism.epsilons(self.delta, list(kinds)).items()}

    def _epsilon_metrics(self) -> dict[str, float]:
        """The round's ``epsilon_<accountant>``, one per ``accountants``: each at every ``accountants_every``-th round
        and the last planned one, else ``budget_accountant``'s alone and NaN for the others (not computed)."""
        every = self.round % self.accountants_every == 0 or self.round == self.rounds_planned
        computed = self.epsilon_metrics(k for k in self.accountants if every or k == self.budget_accountant)
        return {f"epsilon_{k}": computed.get(f"epsilon_{k}", float("nan")) for k in self.accountants}

    def _privacy_metrics(self, agg: PrivateSum, released: Release) -> dict[str, float]:
        """Epsilons so far, the aggregation's statistics, C_t, the server's noise std; the released unclipped
        fraction (adaptive clipping), DP-FedAdamBC's floored fraction, the largest client epsilon."""
        out = self._epsilon_metrics()
        out.update(agg.stats.as_metrics(), clip_norm=released.clip_norm, server_noise_std=agg.server_noise_std())
        if released.unclipped_fraction is not None:
            out["unclipped_fraction_released"] = released.unclipped_fraction
        out.update(self.step.metrics())  # e.g. DP-FedAdamBC's floored fraction
        if len(self.client_ledgers):
            out["client_epsilon_max"] = max(self.client_epsilons().values())
        return out


def _check_accounting(mechanism: GaussianMechanism, budget_accountant: AccountantKind, accountants: Sequence[str],
                      target_epsilon: float | None) -> None:
    """Refuse, naming the argument, what the first round or its budget check would fail on: an unknown accountant,
    a target that is not a number > 0 (NaN would never stop the run) and, under a target, a ``budget_accountant``
    that cannot account the mechanism's releases (:func:`~fedprivacy.privacy.accounting.accounts`). An accountant
    of ``accountants`` that cannot account them reports None (NaN in the round's metrics), as for any ledger."""
    for name, kinds in (("budget_accountant", [budget_accountant]), ("accountants", list(accountants))):
        unknown = [k for k in kinds if k not in get_args(AccountantKind)]
        if unknown:
            raise ValueError(f"{name} must be among {list(get_args(AccountantKind))}, got {unknown[0]!r}")
    if target_epsilon is None:  # no budget check (``budget_accountant`` then only reports the clients' epsilons)
        return
    if not (isinstance(target_epsilon, (int, float)) and target_epsilon > 0):
        raise ValueError(f"target_epsilon must be a number > 0 (or None: no budget), got {target_epsilon!r}")
    ok, what = mechanism.budget_accountable(budget_accountant)
    if not ok:
        raise ValueError(f"budget_accountant={budget_accountant!r} cannot account {what}, the releases of noise_stream="
                         f"{stream_name(mechanism.noise_stream)} with sampling={mechanism.sampling!r}: use 'rdp' (it "
                         "accounts every mechanism)")


def _evaluate(result: Result, evaluate_fn: Callable[[int, ArrayRecord], MetricRecord | None], t: int,
              arrays: ArrayRecord | None) -> dict[str, float]:
    """``evaluate_fn`` at round ``t`` (Flower's central evaluation), kept in ``result``; its metrics as floats."""
    assert arrays is not None
    metrics = evaluate_fn(t, arrays)
    if metrics is None:
        return {}
    result.evaluate_metrics_serverapp[t] = metrics
    return {key: float(v) for key, v in metrics.items()}  # type: ignore[arg-type]
