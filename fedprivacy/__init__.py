"""fedprivacy: federated learning simulations under user-level differential privacy.

The public API (README "Your own model"), importable from here or from its package: the DP strategy for
any Flower ServerApp (:class:`DPFedAvg`), its mechanism (:class:`GaussianMechanism`) and correlated noise for it
(:class:`CorrelatedMechanism`: DP-FTRL's tree, BandMF, BLT); client mods
(:func:`client_noise_mod`, :func:`topk_uplink_mod`) and the answer to a cyclic schedule's identity query
(:func:`answer_identity_query`); SecAgg+ with distributed Skellam noise
(:class:`SecureAggregation` for ``DPFedAvg(aggregation=SecureAggregationPart(...))``, :func:`secure_aggregation_mod` for any ClientApp); record-level DP in any ClientApp
(:func:`make_record_dp`, read on the server by :func:`event_from_metrics`); :class:`AdaDPSOptimizer`;
fedprivacy's in-process engine (:func:`run_inprocess`); the :class:`Task` a user's task implements, and one over
Flower Datasets partitions (:class:`FlowerDatasetsTask`); the
extension interfaces of the privacy core (their docstrings say how to implement one): the server's noise
:class:`NoiseStream` (default :class:`GaussianNoise`) and the :class:`AccountedEvent` a release is accounted as
(:func:`register_event`); the strategy's parts (:class:`Participation` with a
:class:`ParticipationSchedule` of one's own, :class:`Bounding`, :class:`Noise`, :class:`Aggregation`,
:class:`ServerStepPart` with a :class:`ServerOptimizer` of one's own, :class:`Accounting`) and the hooks a run keeps
around its rounds (:class:`RunHook`). Each is imported when first used, so ``import fedprivacy`` stays light (the strategy
loads no config, run folder, pandas or YAML: ``tests/test_public_api.py``).

Layers (imports point downward only; ``tests/test_layers.py``): ``cli`` -> ``experiments``/``run``/``audit``/
``deploy`` -> ``engines`` -> ``fl`` (Flower) -> the StackOverflow tasks -> ``config`` -> core (``client``,
``optim``, ``privacy``, ``models``, ``data``; no Flower) -> ``updates``, ``task``.
"""

from typing import TYPE_CHECKING

from fedprivacy.lazy_exports import lazy_exports
from fedprivacy.fl import EXPORTS as FL_EXPORTS

if TYPE_CHECKING:
    from fedprivacy.engines.inprocess import run_inprocess
    from fedprivacy.fl.aggregation import Aggregation, PlainAggregation, SecureAggregationPart
    from fedprivacy.fl.hooks import RunHook
    from fedprivacy.fl.parts import Accounting, Bounding, Noise, Participation, ServerStepPart
    from fedprivacy.fl.mods import answer_identity_query, client_noise_mod, topk_uplink_mod
    from fedprivacy.fl.record_dp import make_record_dp
    from fedprivacy.fl.secure_aggregation import SecureAggregation, secure_aggregation_mod
    from fedprivacy.fl.strategy import DPFedAvg
    from fedprivacy.flower_datasets import FlowerDatasetsTask
    from fedprivacy.optim.adadps import AdaDPSOptimizer
    from fedprivacy.optim.factory import ServerOptimizer
    from fedprivacy.privacy.client_ledgers import event_from_metrics
    from fedprivacy.privacy.correlated import CorrelatedMechanism
    from fedprivacy.privacy.events import AccountedEvent, register_event
    from fedprivacy.privacy.mechanism import GaussianMechanism
    from fedprivacy.privacy.noise import GaussianNoise, NoiseStream
    from fedprivacy.privacy.sampling import ParticipationSchedule
    from fedprivacy.task import Task

__version__ = "0.1.0"

__all__ = ["AdaDPSOptimizer", "CorrelatedMechanism", "DPFedAvg", "FlowerDatasetsTask", "GaussianMechanism", "Task", "client_noise_mod", "event_from_metrics",
           "make_record_dp", "answer_identity_query", "SecureAggregation", "secure_aggregation_mod", "run_inprocess", "topk_uplink_mod",
           "AccountedEvent", "GaussianNoise", "NoiseStream", "register_event",
           "Aggregation", "PlainAggregation", "SecureAggregationPart",
           "RunHook", "Participation", "Bounding", "Noise", "ServerStepPart", "Accounting", "ParticipationSchedule", "ServerOptimizer"]

__getattr__ = lazy_exports(__name__, {
    **FL_EXPORTS,
    "CorrelatedMechanism": "fedprivacy.privacy.correlated",
    "AdaDPSOptimizer": "fedprivacy.optim.adadps",
    "FlowerDatasetsTask": "fedprivacy.flower_datasets",
    "GaussianMechanism": "fedprivacy.privacy.mechanism",
    "Task": "fedprivacy.task",
    "event_from_metrics": "fedprivacy.privacy.client_ledgers",
    "run_inprocess": "fedprivacy.engines.inprocess",
    "AccountedEvent": "fedprivacy.privacy.events",
    "GaussianNoise": "fedprivacy.privacy.noise",
    "NoiseStream": "fedprivacy.privacy.noise",
    "register_event": "fedprivacy.privacy.events",
    "ParticipationSchedule": "fedprivacy.privacy.sampling",
    "ServerOptimizer": "fedprivacy.optim.factory",
})
