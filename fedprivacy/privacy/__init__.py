"""The privacy core (no config, no Flower): clip, sum, noise, sampling, accounting. Public (imported on first
use): :class:`GaussianMechanism`, the mechanism behind ``DPFedAvg`` and ``fedprivacy run``, and
:class:`CorrelatedMechanism`, noise correlated across rounds (tree, BandMF, BLT), and
:func:`event_from_metrics`, which reads a client's record-level DP event. Extension interfaces (each docstring
says how to implement one): :class:`NoiseStream`, the server's noise across releases (default
:class:`GaussianNoise`, to subclass), passed as ``noise_stream=``, and :class:`AccountedEvent`, what a release is
accounted as, allowed in ledgers, release logs and checkpoints by :func:`register_event`."""

from typing import TYPE_CHECKING

from fedprivacy.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from fedprivacy.privacy.client_ledgers import event_from_metrics
    from fedprivacy.privacy.correlated import CorrelatedMechanism
    from fedprivacy.privacy.events import AccountedEvent, register_event
    from fedprivacy.privacy.mechanism import GaussianMechanism
    from fedprivacy.privacy.noise import GaussianNoise, NoiseStream

__all__ = ["AccountedEvent", "CorrelatedMechanism", "GaussianMechanism", "GaussianNoise", "NoiseStream",
           "event_from_metrics", "register_event"]

__getattr__ = lazy_exports(__name__, {
    "CorrelatedMechanism": "fedprivacy.privacy.correlated",
    "GaussianMechanism": "fedprivacy.privacy.mechanism",
    "GaussianNoise": "fedprivacy.privacy.noise",
    "NoiseStream": "fedprivacy.privacy.noise",
    "AccountedEvent": "fedprivacy.privacy.events",
    "register_event": "fedprivacy.privacy.events",
    "event_from_metrics": "fedprivacy.privacy.client_ledgers",
})
