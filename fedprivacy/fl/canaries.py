r"""Canary clients in ``fedprivacy run``: members of the population whose updates the auditor chose, and the run's
two empirical privacy estimates from them (:mod:`fedprivacy.privacy.canary_estimates`).

``privacy.canaries: {count: k, unused: k'}`` adds ``k`` canaries to the ``N`` users: the run's population is
``N + k``, the sampler samples them like users, and the epsilon the run reports holds for every member, canaries
included. Canary ``i`` has the direction :math:`c_i \sim \mathcal N(0, I_d)` and is included with probability
1/2 (both drawn from a seed held apart from the run's: ``privacy.canaries.seed``, or the OS, kept in the
checkpoint); whenever it is sampled, an included canary replies :math:`\nu C_t\,c_i/\|c_i\|` (``privacy.canaries.norm``
:math:`\nu \ge 1`, default 2: clipped by the server, or under distributed, local and secure placement by its own
client, to exactly :math:`C_t`) and an excluded one a zero update. A server that sums the uploads before clipping
them lets :math:`\nu C_t` through: with :math:`\nu = 10` the canaries see a sensitivity far above the claim's. The ``k'`` unused directions never enter the run.

The canaries are clients: the in-process engine runs ``N + k`` nodes (:func:`population_with_canaries`), the last
``k`` the canaries'. :class:`CanaryGrid`, a wrapper of the run's Flower ``Grid``, adds to every message to canary
``i``'s node the :data:`~fedprivacy.fl.canary_client.CANARY_RECORD` (canary seed, ``i``, included); that node's
ClientApp (fedprivacy's own, :func:`~fedprivacy.fl.client_app.build_client_app`) then sends
:func:`~fedprivacy.fl.canary_client.canary_result` instead of training, through
the client's own upload: as it is (central placement), clipped with the client's own noise share or local noise
(distributed, local: the stream ``(round, partition)`` of any client), or clipped, Skellam-noised and masked by
the SecAgg+ protocol. The strategy samples, clips, noises, aggregates and accounts their replies exactly like
the users' (it cannot tell them apart), whatever the mechanism (independent or correlated noise, a plug-in
noise stream, large-cohort emulation). Under large-cohort emulation the reported epsilon is the emulated
deployment's, so the canaries are held against the epsilon of the noise actually added
(:func:`claim_of_the_added_noise`).

At the end (:meth:`RunCanaries.estimates`) each canary's score is the cosine between the run's model change
:math:`x_T - x_0` and its direction (an adversary who sees the final model only); and, for an adversary who sees
every round, the largest cosine between a round's model change :math:`x_t - x_{t-1}` and its direction, kept as a
running maximum over the rounds (:meth:`RunCanaries.observe`,
:func:`~fedprivacy.privacy.canary_estimates.max_over_rounds`; in the checkpoint). Of each score:

- Andrew et al. (arXiv:2302.03098, Alg. 1): the included canaries' cosines against those of the excluded ones
  and the unused directions (:func:`~fedprivacy.privacy.canary_estimates.one_shot_epsilon`);
- Steinke et al. (arXiv:2305.08846, Thm. 3.1): guesses "included" for the ``k // 4`` highest scores and
  "excluded" for the ``k // 4`` lowest, abstaining on the middle half
  (:func:`~fedprivacy.privacy.canary_estimates.one_run_bound`).
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Iterator
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from flwr.app import ConfigRecord, Message, RecordDict
from flwr.serverapp import Grid

from fedprivacy.config import CanaryConfig, RunConfig
from fedprivacy.fl.canary_client import CANARY_RECORD, canary_direction, canary_update
from fedprivacy.fl.population import discover_nodes
from fedprivacy.privacy.accounting import AccountantKind, PrivacyLedger, epsilon
from fedprivacy.privacy.canary_estimates import cosines, max_over_rounds, one_run_bound, one_shot_epsilon

if TYPE_CHECKING:
    from fedprivacy.privacy.mechanism import GaussianMechanism

log = logging.getLogger(__name__)

INCLUSION_STREAM = 0x696E636C  # "incl": which canaries are included
BOOTSTRAP_STREAM = 0x626F6F74  # "boot": the one-shot estimate's bootstrap
DIRECTION_CACHE_BYTES = 1 << 26  # every direction kept in memory (float32) up to 64 MiB: 140 at 100,050 parameters
SCORE_CHUNK = 1 << 22  # directions' values scored at once (64 directions at most): 32 MiB as float64
def population_with_canaries(cfg: RunConfig, users: int) -> int:
    """The run's population: its ``users`` and, after them, ``privacy.canaries.count`` canary nodes."""
    return users + (cfg.privacy.canaries.count if cfg.privacy.canaries is not None else 0)


class RunCanaries:
    """The canaries of one run over ``users`` users and a model of ``dim`` parameters (module docstring)."""

    def __init__(self, cfg: CanaryConfig, users: int, dim: int) -> None:
        self.cfg, self.users, self.dim = cfg, users, dim
        self.seed = cfg.seed if cfg.seed is not None else secrets.randbits(63)
        self.round_max: np.ndarray | None = None  # every direction's largest cosine with a round's change so far
        self._last = torch.zeros(0)  # x_{t-1}, from :meth:`start`
        self._directions: torch.Tensor | None = None  # (count + unused) x dim, when they fit DIRECTION_CACHE_BYTES

    @property
    def count(self) -> int:
        return self.cfg.count

    @property
    def included(self) -> np.ndarray:
        """Whether each canary is included (probability 1/2 each, from the canary seed)."""
        return np.random.default_rng(np.random.SeedSequence([self.seed, INCLUSION_STREAM])).random(self.count) < 0.5

    def direction(self, i: int) -> torch.Tensor:
        """Unit direction ``i`` (``0..count-1``: the canaries, ``count..count+unused-1``: the unused ones)."""
        return canary_direction(self.seed, i, self.dim)

    def update(self, i: int, clip_norm: float) -> torch.Tensor:
        """Canary ``i``'s reply: its direction at ``privacy.canaries.norm * clip_norm`` if included, else zero."""
        return canary_update(self.seed, i, bool(self.included[i]), self.dim, clip_norm, self.cfg.norm)

    def state_dict(self) -> dict[str, Any]:
        return {"seed": self.seed, "round_max": None if self.round_max is None else self.round_max.tolist()}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the seed a run started with (its directions and inclusions; a configured seed must match it) and
        the every-round statistic so far (absent from a checkpoint written before it existed: the run's earlier
        rounds would be missing from it, so it is refused)."""
        if self.cfg.seed is not None and state["seed"] != self.cfg.seed:
            raise ValueError(f"privacy.canaries.seed={self.cfg.seed} differs from the seed the run started with: its "
                             "canaries would change mid-run")
        if "round_max" not in state:
            raise ValueError("the checkpoint's canaries hold no every-round statistic (written by an older version): "
                             "its rounds so far cannot be scored; rerun the run from the start")
        self.seed = state["seed"]
        self.round_max = None if state["round_max"] is None else np.asarray(state["round_max"], dtype=np.float64)

    def start(self, params: torch.Tensor) -> None:
        """The run (re)starts from the released model ``params`` (``x_t``, flat): the next round's change is taken
        from it."""
        self._last = params.detach().clone()

    def observe(self, params: torch.Tensor) -> None:
        """Round ``t`` released ``params`` (``x_t``, flat): score its model change :math:`x_t - x_{t-1}` into the
        every-round statistic."""
        self.round_max = max_over_rounds(self.round_max, self.scores(params - self._last))
        self._last = params.detach().clone()

    def grid(self, grid: Grid) -> CanaryGrid:
        return CanaryGrid(grid, self)

    def scores(self, change: torch.Tensor) -> np.ndarray:
        """Cosines of ``change`` with every direction (canaries, then unused): from the directions kept in memory when
        they fit :data:`DIRECTION_CACHE_BYTES` (the every-round score asks each round), else regenerated
        :data:`SCORE_CHUNK` values at a time."""
        total, step = self.count + self.cfg.unused, max(1, min(64, SCORE_CHUNK // self.dim))
        flat = change.detach().to("cpu", torch.float32)
        if self._directions is None and total * self.dim * 4 <= DIRECTION_CACHE_BYTES:
            self._directions = torch.stack([self.direction(i) for i in range(total)])
        if self._directions is not None:
            return cosines(flat, self._directions)
        return np.concatenate([cosines(flat, torch.stack([self.direction(i) for i in range(a, min(a + step, total))]))
                               for a in range(0, total, step)])

    def estimates(self, change: torch.Tensor, delta: float) -> dict[str, Any]:
        """Both estimates for the run's model change ``x_T - x_0`` at ``delta`` (summary.json's ``empirical_epsilon``),
        and both of the every-round statistic (``every_round``; None before any round)."""
        inc = self.included
        drawn = {"canaries": self.count, "included": int(inc.sum()), "unused": self.cfg.unused, "delta": delta}
        if inc.sum() < 2:  # a draw, not an error of the run's: it must still end with its summary
            return {**drawn, "error": f"{int(inc.sum())} of the {self.count} canaries were included (each with "
                                      "probability 1/2): the one-shot estimate needs at least 2; use more canaries"}
        try:
            return {**drawn, **self._estimates_of(self.scores(change), delta),
                    "every_round": None if self.round_max is None else self._estimates_of(self.round_max, delta)}
        except (ArithmeticError, ValueError) as err:  # an estimator's numerical failure must not cost the summary
            log.error("the canary estimates failed (%s: %s); the run's summary records it", type(err).__name__, err)
            return {**drawn, "error": f"the estimate failed: {type(err).__name__}: {err}"}

    def _estimates_of(self, scores: np.ndarray, delta: float) -> dict[str, Any]:
        """Andrew et al.'s and Steinke et al.'s estimates of one score per direction (canaries, then unused)."""
        inc = self.included
        canary, unused = scores[:self.count], scores[self.count:]
        beta = 1 - self.cfg.confidence
        andrew = one_shot_epsilon(canary[inc], np.concatenate([canary[~inc], unused]), delta,
                                  confidence=self.cfg.confidence,
                                  rng=np.random.default_rng(np.random.SeedSequence([self.seed, BOOTSTRAP_STREAM])))
        steinke = one_run_bound(canary, inc, self.count // 4, self.count // 4, delta, beta)
        return {"andrew": {"epsilon": andrew.epsilon, "interval": list(andrew.interval),
                           "epsilon_separate_variances": andrew.epsilon_separate,
                           "interval_separate_variances": list(andrew.interval_separate),
                           "confidence": andrew.confidence, "inserted": andrew.inserted,
                           "unobserved": andrew.unobserved, "cosine_mean": andrew.mean, "cosine_std": andrew.std,
                           "null_cosine_mean": andrew.null_mean, "null_cosine_std": andrew.null_std},
                "steinke": {"epsilon_lower_bound": steinke.epsilon_lower_bound, "confidence": steinke.confidence,
                            "guesses": steinke.guesses, "correct": steinke.correct}}

    def report(self, change: torch.Tensor, mechanism: GaussianMechanism, delta: float, accountant: AccountantKind,
               reported: float | None) -> dict[str, Any]:
        """summary.json's ``empirical_epsilon``: :meth:`estimates` and the claim they test, ``epsilon_claimed``
        (:func:`claim_of_the_added_noise`); ``reported``: the run's reported epsilon under ``accountant``."""
        claimed, what = claim_of_the_added_noise(mechanism, delta, accountant, reported)
        return {**self.estimates(change, delta), "accountant": accountant, "epsilon_claimed": claimed, "claim": what,
                "epsilon_reported": reported}


def claim_of_the_added_noise(mechanism: GaussianMechanism, delta: float, accountant: AccountantKind,
                             reported: float | None) -> tuple[float | None, str]:
    r"""The epsilon the canaries test, and what it is: the run's ``reported`` epsilon, except under large-cohort
    emulation (``privacy.noise_cohort`` :math:`M`), whose reported epsilon is the emulated deployment's (cohort
    :math:`M` of its own population) and does not hold for the simulated run. The canaries see the noise actually
    added, std :math:`zCm/M` on the sum of the simulated cohort of :math:`m`, so their claim is the epsilon of
    the run's releases with the run's own sampler (:math:`q = m/N`, :math:`N` the simulated population, canaries
    included) and noise multiplier :math:`zm/M`, composed by ``accountant``."""
    if mechanism.noise_cohort is None:
        return reported, "the run's reported epsilon"
    z = mechanism.value_noise_multiplier
    ledger = PrivacyLedger([(mechanism.noise.event(mechanism.sampler.round_event(z, r), mechanism.stream_release(r)), 1)
                            for r in range(1, mechanism.ledger.rounds + 1)])
    return (epsilon(ledger, delta, accountant),
            f"the simulated run's (noise multiplier z m/M = {z:.4g}, cohort {mechanism.expected_cohort} of "
            f"{mechanism.population}), not the emulated deployment's reported {reported}")


class CanaryGrid(Grid):
    """The run's ``grid``, whose last ``count`` partition nodes are the canaries' (module docstring): every message
    to canary ``i``'s node carries the :data:`~fedprivacy.fl.canary_client.CANARY_RECORD`
    ``{seed, index, included, norm}`` its ClientApp answers with (:func:`~fedprivacy.fl.canary_client.canary_result`); everything else, e.g. the nodes'
    states, is the wrapped grid's. The nodes are the grid's partitions in order: an in-process grid names them, real SuperNodes report them
    (:func:`~fedprivacy.fl.population.discover_nodes`; a deployment runs one SuperNode per canary after the users')."""

    def __init__(self, grid: Grid, canaries: RunCanaries) -> None:
        self.inner, self.canaries = grid, canaries
        try:
            nodes = discover_nodes(grid, canaries.users + canaries.count)
        except RuntimeError as err:
            raise ValueError(f"{err}: a run with {canaries.count} canaries over {canaries.users} users needs "
                             f"{canaries.users + canaries.count} nodes (the canaries last)") from None
        self._nodes = nodes
        included = canaries.included
        self._record = {node: ConfigRecord({"seed": canaries.seed, "index": i, "included": bool(included[i]),
                                            "norm": canaries.cfg.norm})
                        for i, node in enumerate(nodes[canaries.users:])}

    def __getattr__(self, name: str) -> Any:  # node_state_dict, load_node_state_dict, close, partition_nodes, ...
        return getattr(self.inner, name)

    def partition_nodes(self) -> list[int]:
        """The nodes in partition order, as discovered once here (a run's population order asks again: real
        SuperNodes are not queried twice)."""
        return list(self._nodes)

    @property
    def run(self):  # type: ignore[override]
        return self.inner.run

    def set_run(self, run_id: int) -> None:
        self.inner.set_run(run_id)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return self.inner.get_node_ids()

    def _tag(self, msg: Message) -> Message:
        """``msg`` with its canary's record, on a copy of its content (a broadcast's records are shared)."""
        record = self._record.get(msg.metadata.dst_node_id)
        if record is not None:
            msg.content = RecordDict({**msg.content, CANARY_RECORD: record})
        return msg

    def _split(self, messages: Iterable[Message]) -> tuple[list[Message], list[Message]]:
        messages = [self._tag(m) for m in messages]
        return ([m for m in messages if m.metadata.dst_node_id not in self._record],
                [m for m in messages if m.metadata.dst_node_id in self._record])

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        return self.inner.push_messages([self._tag(m) for m in messages])

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        return self.inner.pull_messages(message_ids)

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterator[Message]:
        """The users' replies from the wrapped grid (lazily), then the canaries' (their ClientApps' replies)."""
        theirs, ours = self._split(messages)
        for batch in (theirs, ours):
            if batch:
                yield from self.inner.send_and_receive(batch, timeout=timeout)
