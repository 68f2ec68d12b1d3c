"""Which of the strategy's parts can run together, asked in one place (:func:`refuse_incompatible`).

Each part of :class:`~fedprivacy.fl.strategy.DPFedAvg` that cannot run with some choice of another part says so
through one optional hook, ``refusal(combination) -> str | None``, reading the :class:`Combination` of the strategy's
choices: the aggregation part (:class:`~fedprivacy.fl.aggregation.SecureAggregationPart` refuses record-level events
and DiSK: the masked upload carries neither), DiSK's filter (:class:`~fedprivacy.optim.disk.DiskFilter` refuses noise
correlated across rounds: its Kalman filter, Zhang et al. 2024, arXiv:2410.03883, Alg. 3, models independent noise)
and the server optimizer. The strategy asks every part once, after building them, before anything runs.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass


@dataclass(frozen=True)
class Combination:
    """The strategy's choices a part may refuse to run with."""

    record_level: bool
    """The clients train with record-level DP and report its event with their update."""
    disk: bool
    """DiSK's filter runs: the clients may send a combined update from two points."""
    noise_stream: str
    """The server's noise stream, by name (:func:`~fedprivacy.privacy.noise.stream_name`)."""
    independent_noise: bool
    """The noise of different releases is independent (False for the correlated mechanisms)."""


def refuse_incompatible(parts: Iterable[object], combination: Combination) -> None:
    """Raise ``ValueError`` with the first refusal of a part of ``parts`` (their ``refusal`` hook) of
    ``combination``; parts without the hook (None among them) refuse nothing."""
    for part in parts:
        hook = getattr(part, "refusal", None)
        reason = None if hook is None else hook(combination)
        if reason is not None:
            raise ValueError(reason)
