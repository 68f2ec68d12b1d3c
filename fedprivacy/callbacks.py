"""What a run calls after each recorded round: :data:`RoundCallback` (``fedprivacy run``'s ``on_round``, the
strategy's ``DPFedAvg(on_round=...)``, the trackers of :mod:`fedprivacy.tracking`). No fedprivacy imports: every
layer may name it."""

from __future__ import annotations

from collections.abc import Callable, Mapping

RoundCallback = Callable[[int, Mapping[str, float]], None]
"""Called with ``(round, metrics)`` once a round is recorded: a ``metrics.csv`` row (``fedprivacy run``) or the
round's strategy metrics (:class:`~fedprivacy.fl.strategy.DPFedAvg`'s ``on_round``)."""
