"""The privacy core (no config, no Flower): clip, sum, noise, sampling, accounting. Public (imported on first
use): :class:`GaussianMechanism`, the mechanism behind ``DPFedAvg`` and ``fedprivacy run``, and
:class:`CorrelatedMechanism`, noise correlated across rounds (tree, BandMF, BLT), and
:func:`event_from_metrics`, which reads a client's record-level DP event."""

from typing import TYPE_CHECKING

from fedprivacy.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from fedprivacy.privacy.client_ledgers import event_from_metrics
    from fedprivacy.privacy.correlated import CorrelatedMechanism
    from fedprivacy.privacy.mechanism import GaussianMechanism

__all__ = ["CorrelatedMechanism", "GaussianMechanism", "event_from_metrics"]

__getattr__ = lazy_exports(__name__, {
    "CorrelatedMechanism": "fedprivacy.privacy.correlated",
    "GaussianMechanism": "fedprivacy.privacy.mechanism",
    "event_from_metrics": "fedprivacy.privacy.client_ledgers",
})
