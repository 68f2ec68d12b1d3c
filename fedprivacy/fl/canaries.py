r"""Canary clients in ``fedprivacy run``: members of the population whose updates the auditor chose, and the run's
two empirical privacy estimates from them (:mod:`fedprivacy.privacy.canary_estimates`).

``privacy.canaries: {count: k, unused: k'}`` adds ``k`` canaries to the ``N`` users: the run's population is
``N + k``, the sampler samples them like users, and the epsilon the run reports holds for every member, canaries
included. Canary ``i`` has the direction :math:`c_i \sim \mathcal N(0, I_d)` and is included with probability
1/2 (both drawn from a seed held apart from the run's: ``privacy.canaries.seed``, or the OS, kept in the
checkpoint); whenever it is sampled, an included canary replies :math:`2C_t\,c_i/\|c_i\|` (clipped by the
server to exactly :math:`C_t`) and an excluded one a zero update. The ``k'`` unused directions never enter the run.

The canaries are answered by :class:`CanaryGrid`, a wrapper of the run's Flower ``Grid`` that gives them node
ids after the users' and answers their ``train`` messages itself: the strategy samples, clips, noises and
accounts their replies exactly like the users' (it cannot tell them apart), and neither the strategy nor the
ClientApp changes.

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

import secrets
from collections.abc import Iterable, Iterator
from typing import Any
from uuid import uuid4

import numpy as np
import torch
from flwr.app import Error, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedprivacy.config import CanaryConfig
from fedprivacy.fl.population import discover_nodes
from fedprivacy.fl.records import update_to_record
from fedprivacy.privacy.canary_estimates import cosines, max_over_rounds, one_run_bound, one_shot_epsilon
from fedprivacy.privacy.noise import torch_seed
from fedprivacy.updates import SparseUpdate

DIRECTION_STREAM = 0x64697263  # "dirc": canary i's direction, per canary seed
INCLUSION_STREAM = 0x696E636C  # "incl": which canaries are included
BOOTSTRAP_STREAM = 0x626F6F74  # "boot": the one-shot estimate's bootstrap
CANARY_NORM = 2.0  # an included canary's norm, in units of the round's clip norm: always clipped to exactly C_t
DIRECTION_CACHE_BYTES = 1 << 26  # every direction kept in memory (float32) up to 64 MiB: 140 at 100,050 parameters
SCORE_CHUNK = 1 << 22  # directions' values scored at once (64 directions at most): 32 MiB as float64
NOT_A_TRAIN_MESSAGE = 1  # error code of a canary's reply to anything but ``train``


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
        g = torch.Generator().manual_seed(torch_seed(np.random.SeedSequence([self.seed, DIRECTION_STREAM, i])))
        c = torch.randn(self.dim, generator=g)
        return c / torch.linalg.vector_norm(c)

    def update(self, i: int, clip_norm: float) -> torch.Tensor:
        """Canary ``i``'s reply: its direction at ``CANARY_NORM * clip_norm`` if included, else zero."""
        return self.direction(i) * (CANARY_NORM * clip_norm) if self.included[i] else torch.zeros(self.dim)

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
        return {"canaries": self.count, "included": int(inc.sum()), "unused": self.cfg.unused, "delta": delta,
                **self._estimates_of(self.scores(change), delta),
                "every_round": None if self.round_max is None else self._estimates_of(self.round_max, delta)}

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


MAX_NODE_ID = (1 << 64) - 1  # Flower's node ids are unsigned 64-bit


def canary_node_ids(users: Iterable[int], count: int) -> list[int]:
    """``count`` node ids that no user has: the ones after the largest user's, or where those would pass
    :data:`MAX_NODE_ID` (a real SuperNode's id is a random 64-bit number), the smallest positive free ones."""
    taken = set(users)
    base = max(taken, default=0) + 1
    if base + count - 1 <= MAX_NODE_ID:
        return list(range(base, base + count))
    ids: list[int] = []
    candidate = 1
    while len(ids) < count:
        if candidate not in taken:
            ids.append(candidate)
        candidate += 1
    return ids


class CanaryGrid(Grid):
    """The run's ``grid`` with the canaries' nodes added after its own (module docstring); everything else, e.g.
    the nodes' states, is the wrapped grid's. The users' nodes are the grid's partitions in order: an in-process
    grid names them, real SuperNodes report them (:func:`~fedprivacy.fl.population.discover_nodes`)."""

    def __init__(self, grid: Grid, canaries: RunCanaries) -> None:
        self.inner, self.canaries = grid, canaries
        users = discover_nodes(grid, canaries.users)
        ids = canary_node_ids(users, canaries.count)
        self._nodes = users + ids
        self._canary_of = {node: i for i, node in enumerate(ids)}
        self._replies: dict[str, Message] = {}

    def __getattr__(self, name: str) -> Any:  # node_state_dict, load_node_state_dict, close, ...
        return getattr(self.inner, name)

    def partition_nodes(self) -> list[int]:
        """The users' nodes, then the canaries'."""
        return list(self._nodes)

    @property
    def run(self):  # type: ignore[override]
        return self.inner.run

    def set_run(self, run_id: int) -> None:
        self.inner.set_run(run_id)

    def create_message(self, *args: Any, **kwargs: Any) -> Message:
        return self.inner.create_message(*args, **kwargs)

    def get_node_ids(self) -> Iterable[int]:
        return list(self.inner.get_node_ids()) + list(self._canary_of)

    def _reply(self, msg: Message) -> Message:
        if msg.metadata.message_type != "train":
            return Message(Error(code=NOT_A_TRAIN_MESSAGE, reason="canary clients answer train messages only"),
                           reply_to=msg)
        clip_norm = float(msg.content["config"]["clip-norm"])
        update = self.canaries.update(self._canary_of[msg.metadata.dst_node_id], clip_norm)
        return Message(RecordDict({"arrays": update_to_record(SparseUpdate.dense(update)),
                                   "metrics": MetricRecord({"num-examples": 0})}), reply_to=msg)

    def _split(self, messages: Iterable[Message]) -> tuple[list[Message], list[Message]]:
        messages = list(messages)
        return ([m for m in messages if m.metadata.dst_node_id not in self._canary_of],
                [m for m in messages if m.metadata.dst_node_id in self._canary_of])

    def push_messages(self, messages: Iterable[Message]) -> Iterable[str]:
        theirs, ours = self._split(messages)
        ids = list(self.inner.push_messages(theirs)) if theirs else []
        for msg in ours:
            key = str(uuid4())
            self._replies[key] = self._reply(msg)
            ids.append(key)
        return ids

    def pull_messages(self, message_ids: Iterable[str]) -> Iterable[Message]:
        ids = list(message_ids)
        theirs = [i for i in ids if i not in self._replies]
        ours = [self._replies.pop(i) for i in ids if i in self._replies]
        return (list(self.inner.pull_messages(theirs)) if theirs else []) + ours

    def send_and_receive(self, messages: Iterable[Message], *, timeout: float | None = None) -> Iterator[Message]:
        """The users' replies from the wrapped grid (lazily), then the canaries'."""
        theirs, ours = self._split(messages)
        if theirs:
            yield from self.inner.send_and_receive(theirs, timeout=timeout)
        for msg in ours:
            yield self._reply(msg)
