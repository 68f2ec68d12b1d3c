r"""How a round's uploads become ONE release: the strategy's aggregation part (:class:`Aggregation`).

:class:`~fedprivacy.fl.strategy.DPFedAvg` calls its part the same way whatever it is, with no branch on which:

1. :meth:`Aggregation.mechanism` builds the mechanism the part releases through (its noise and its ledger), and
   :meth:`Aggregation.adopt` tells it the model's size;
2. :meth:`Aggregation.messages_for` turns the round's broadcast into one train message's content per node;
3. :meth:`Aggregation.release` turns the replies into a :class:`Released` (the mechanism's
   :class:`~fedprivacy.privacy.mechanism.Release`, logged ahead and accounted by the mechanism) or an :class:`Abort`
   (nothing released; the round's metrics say why);
4. :meth:`Aggregation.settings` is what the part adds to the strategy's settings (what a resume may not change), and
   :meth:`Aggregation.refusal` names an option it cannot be combined with (:mod:`fedprivacy.privacy.combination`).

Two built-in parts:

* :class:`PlainAggregation`: the server clips each update to :math:`C_t`, sums, and the mechanism adds ONE draw and
  divides by the expected cohort (McMahan et al. 2018, arXiv:1710.06963, Alg. 1):
  :math:`g_t = \frac1m\big(\sum_{i} \operatorname{clip}(u_i, C_t) + \mathcal N(0, z^2 C_t^2 I)\big)`;
* :class:`SecureAggregationPart`: SecAgg+ (Bell et al. 2020, arXiv:2009.08722) over the clients' Skellam shares
  (Agarwal et al. 2021, arXiv:2110.04995): the server learns only the sum modulo :math:`2^b` of the survivors'
  uploads, :math:`g_t = \frac1m \mathrm{decode}\big(\sum_{i \in S'_t} v_i \bmod 2^b\big)`, accounted with the noise
  the survivors actually added (:mod:`fedprivacy.privacy.secure_mechanism`).

A part of one's own implements :class:`Aggregation`; whatever it sums, it must release through the mechanism
(:meth:`~fedprivacy.privacy.mechanism.GaussianMechanism.release`: logged ahead, noised, accounted) and keep each
node's contribution within the sensitivity the mechanism accounts (one update of norm at most :math:`C_t`).
A part holds per-round state (SecAgg+'s protocol between configure and aggregate): one part per strategy.
"""

from __future__ import annotations

import logging
import secrets
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

import numpy as np
from flwr.app import ArrayRecord, ConfigRecord, Message, MetricRecord, RecordDict
from flwr.serverapp import Grid

from fedprivacy.privacy.combination import Combination
from fedprivacy.fl.records import record_nbytes, reply_content, typed_record
from fedprivacy.fl.secure_aggregation import SECAGG, SecAggAborted, SecAggRound, SecureAggregation, masked_upload
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.mechanism import GaussianMechanism, Release
from fedprivacy.privacy.secure_mechanism import SecureSum, SkellamMechanism
from fedprivacy.privacy.skellam import IntegrityCheckFailed
from fedprivacy.updates import RejectedUpdate

if TYPE_CHECKING:
    from fedprivacy.fl.strategy import DPFedAvg

log = logging.getLogger(__name__)

ROTATION_STREAM = 0x726F74  # "rot": a seeded simulation's rotation seeds, disjoint from its other streams

Content = Mapping[str, ArrayRecord | ConfigRecord]
"""One train message's records (``arrays``, ``config``, and what the parts add)."""


@dataclass
class Diagnostics:
    """What a round's accepted replies said besides their updates (diagnostics, never released)."""

    losses: list[float] = field(default_factory=list)
    uplink: list[int] = field(default_factory=list)
    residual: list[float] = field(default_factory=list)

    def add(self, content: RecordDict) -> None:
        reported: Mapping[str, Any] = typed_record(content, "metrics", MetricRecord) or {}
        numbers = {k: float(v) for k, v in reported.items() if isinstance(v, (int, float)) and not isinstance(v, bool)}
        arrays = typed_record(content, "arrays", ArrayRecord)
        assert arrays is not None, "an accepted reply carries its update as the ArrayRecord 'arrays'"
        self.uplink.append(record_nbytes(arrays))
        if "train_loss" in numbers:
            self.losses.append(numbers["train_loss"])
        if "residual-bytes" in numbers:
            self.residual.append(numbers["residual-bytes"])

    def metrics(self) -> dict[str, float]:
        out = {"train_loss": _mean(self.losses), "uplink_bytes_per_client": _mean(self.uplink)}
        if self.residual:
            out["residual_bytes_per_client"] = _mean(self.residual)
        return out


def _mean(values: Sequence[float]) -> float:
    return sum(values) / len(values) if values else float("nan")


@dataclass
class Released:
    """A round that released: the sum it was made from, the mechanism's release, the accepted replies'
    diagnostics and any metrics of the part's own."""

    agg: PrivateSum
    release: Release
    diagnostics: Diagnostics
    metrics: dict[str, float] = field(default_factory=dict)


@dataclass
class Abort:
    """A round that released nothing (the model stays as it was); ``metrics``: the round's, saying why."""

    metrics: dict[str, float]


@runtime_checkable
class Aggregation(Protocol):
    """How the strategy turns a round's uploads into one release (module docstring)."""

    def settings(self) -> dict[str, Any]:
        """What this part adds to :attr:`DPFedAvg.settings` (a resume with other values is refused naming them)."""

    def refusal(self, combination: Combination) -> str | None:
        """Why this part cannot run with the strategy's other choices (e.g. record-level events, DiSK's second
        update), or None when it can (:func:`~fedprivacy.privacy.combination.refuse_incompatible`)."""

    def mechanism(self, mechanism_cls: type[GaussianMechanism], args: Mapping[str, Any]) -> GaussianMechanism:
        """The mechanism it releases through, from the strategy's mechanism class and arguments."""

    def adopt(self, mechanism: GaussianMechanism, dim: int) -> None:
        """The strategy holds a model of ``dim`` values."""

    def messages_for(self, strategy: DPFedAvg, grid: Grid, t: int, cohort: list[int],
                     content: Content) -> list[tuple[int, Content]]:
        """Round ``t``'s train messages: ``(node, content)`` for each node to send one to (none: nothing runs)."""

    def release(self, strategy: DPFedAvg, t: int, replies: Iterable[Message]) -> Released | Abort:
        """Round ``t``'s replies as one release (through ``strategy.mechanism``), or why there is none."""


class PlainAggregation:
    """The server clips and sums every accepted update as it streams in (:class:`PrivateSum`) and the mechanism
    adds its noise and divides (module docstring)."""

    def settings(self) -> dict[str, Any]:
        """Nothing beyond the mechanism's settings."""
        return {}

    def refusal(self, combination: Combination) -> str | None:
        """Every combination: the replies carry their events and DiSK's combined update in the clear."""
        return None

    def mechanism(self, mechanism_cls: type[GaussianMechanism], args: Mapping[str, Any]) -> GaussianMechanism:
        """``mechanism_cls(**args)`` (the audit's broken variants substitute their class)."""
        return mechanism_cls(**args)

    def adopt(self, mechanism: GaussianMechanism, dim: int) -> None:
        """The Gaussian mechanism's scale does not depend on the model's size."""

    def messages_for(self, strategy: DPFedAvg, grid: Grid, t: int, cohort: list[int],
                     content: Content) -> list[tuple[int, Content]]:
        """The broadcast to every sampled node."""
        return [(node, content) for node in cohort]

    def release(self, strategy: DPFedAvg, t: int, replies: Iterable[Message]) -> Released:
        """Clip and sum the replies at C_t, report the rejections, then the mechanism's release."""
        agg = strategy.aggregator()
        diagnostics = strategy.collect(t, replies, agg)
        strategy.report_rejections(agg)
        return Released(agg, strategy.mechanism.release(agg, t), diagnostics)


class SecureAggregationPart:
    """SecAgg+ with the distributed Skellam mechanism (module docstring; :mod:`fedprivacy.fl.secure_aggregation`).

    Args:
        config: SecAgg+'s parameters (threshold, neighbours, bits, timeout).
    """

    def __init__(self, config: SecureAggregation) -> None:
        self.config = config
        self._round: SecAggRound | None = None  # this round's protocol, between configure and aggregate

    def settings(self) -> dict[str, Any]:
        """``secure_aggregation``: SecAgg+'s parameters."""
        return {"secure_aggregation": asdict(self.config)}

    def refusal(self, combination: Combination) -> str | None:
        """The masked upload carries neither a record-level event nor DiSK's second update."""
        if combination.record_level or combination.disk:
            return ("secure_aggregation: record_level and disk_kappa are not supported (the masked upload carries "
                    "neither an event nor a second update)")
        return None

    def mechanism(self, mechanism_cls: type[GaussianMechanism], args: Mapping[str, Any]) -> GaussianMechanism:
        """:class:`SkellamMechanism` (whose budget check assumes as few as ``threshold`` shares)."""
        return SkellamMechanism(bits=self.config.bits, min_shares=self.config.threshold, **args)

    def adopt(self, mechanism: GaussianMechanism, dim: int) -> None:
        """The Skellam mechanism's scale and sensitivities depend on ``d``."""
        assert isinstance(mechanism, SkellamMechanism)
        mechanism.dim = dim

    def messages_for(self, strategy: DPFedAvg, grid: Grid, t: int, cohort: list[int],
                     content: Content) -> list[tuple[int, Content]]:
        """Run SecAgg+'s setup and key stages with the cohort, then the broadcast with each receiver's collect
        record; none when the protocol aborts before it (logged: nothing released, nothing accounted)."""
        self._round = SecAggRound(grid, self.config, t, rotation_seed(strategy.mechanism.seed, t), list(cohort))
        try:
            receivers = self._round.prepare()
        except SecAggAborted as err:
            log.error("%s: nothing released, nothing accounted", err)
            return []
        return [(node, {**content, SECAGG: self._round.collect_content(node)}) for node in receivers]

    def release(self, strategy: DPFedAvg, t: int, replies: Iterable[Message]) -> Released | Abort:
        """The SecAgg+ round's end: sum the masked uploads mod 2^b, check the survivors, log the release ahead with
        the noise they added, unmask, decode. Below the threshold the round ends with one logged line, the model
        unchanged and nothing accounted. Each stage's failed nodes are logged and counted (``secagg_failed_<stage>``);
        ``cohort_dropped`` counts the sampled nodes that failed before their masked upload, ``secagg_survivors`` the
        uploads accepted."""
        secagg, self._round = self._round, None
        assert secagg is not None
        agg = strategy.aggregator()
        assert isinstance(agg, SecureSum)
        agg.rotation_seed = secagg.rotation_seed
        diagnostics = Diagnostics()
        for node, reply in strategy.answers(t, replies):
            try:
                content = reply_content(reply)
                values = masked_upload(content, agg.params.padded_dim, agg.params.bits)
            except RejectedUpdate as err:
                agg.reject(err.reason, f"node {node}", str(err))
                secagg.fail("collect", node, str(err))
                continue
            agg.add_masked(node, values)
            diagnostics.uplink.append(record_nbytes(content.array_records[SECAGG]))
        for node in secagg.shared - set(agg.survivors):
            secagg.fail("collect", node, "no reply")

        def metrics(aborted: bool) -> dict[str, float]:
            return {**strategy.round_metrics(), "cohort_dropped": float(secagg.dropped_before_upload()),
                    "secagg_aborted": float(aborted), "secagg_integrity_refused": 0.0,
                    "secagg_survivors": float(len(agg.survivors)), **secagg.failure_metrics()}

        if not secagg.shared:  # aborted before the model was sent (logged then): no message went out, no reply came
            return Abort(metrics(True))
        try:
            secagg.check(agg.survivors)
        except SecAggAborted as err:
            log.error("%s: nothing released, nothing accounted", err)
            return Abort(metrics(True))
        strategy.report_rejections(agg)
        agg.unmask = lambda: secagg.unmask(agg.survivors, agg.params.padded_dim)
        try:
            released = strategy.mechanism.release(agg, t)
        except SecAggAborted as err:
            log.error("%s: nothing released; the release logged ahead stays accounted", err)
            return Abort(metrics(True))
        except IntegrityCheckFailed as err:
            log.error("round %d refused: %s; nothing released, the release logged ahead stays accounted", t, err)
            return Abort({**metrics(False), "secagg_integrity_refused": 1.0})
        return Released(agg, released, diagnostics, metrics(False))


def rotation_seed(seed: int | None, t: int) -> int:
    """Round ``t``'s public rotation seed: from the OS, or (a seeded simulation) from ``seed`` and the round."""
    if seed is None:
        return secrets.randbits(63)
    return int(np.random.SeedSequence([seed, ROTATION_STREAM, t]).generate_state(1, np.uint64)[0] >> 1)


def aggregation_of(aggregation: Aggregation | None, secure_aggregation: SecureAggregation | None) -> Aggregation:
    """The strategy's part: ``aggregation`` as given, :class:`SecureAggregationPart` for ``secure_aggregation``
    (the keyword form), else :class:`PlainAggregation`."""
    if aggregation is not None and secure_aggregation is not None:
        raise ValueError("give aggregation=SecureAggregationPart(...) or secure_aggregation=..., not both")
    if aggregation is not None:
        return aggregation
    return PlainAggregation() if secure_aggregation is None else SecureAggregationPart(secure_aggregation)
