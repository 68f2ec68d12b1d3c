"""The privacy core (no config, no Flower): clip, sum, noise, sampling, accounting. Public (imported on first
use): :class:`GaussianMechanism`, the mechanism behind ``DPFedAvg`` and ``fedprivacy run``, and
:func:`event_from_metrics`, which reads a client's record-level DP event."""

from typing import TYPE_CHECKING

from fedprivacy.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from fedprivacy.privacy.client_ledgers import event_from_metrics
    from fedprivacy.privacy.mechanism import GaussianMechanism

__all__ = ["GaussianMechanism", "event_from_metrics"]

__getattr__ = lazy_exports(__name__, {
    "GaussianMechanism": "fedprivacy.privacy.mechanism",
    "event_from_metrics": "fedprivacy.privacy.client_ledgers",
})
