"""Flower's layer: fedprivacy's ServerApp and ClientApp, and what any Flower app can use (imported on first use):
the DP strategy :class:`DPFedAvg`, the client mods :func:`client_noise_mod` and :func:`topk_uplink_mod`,
:func:`answer_identity_query` (a cyclic schedule's identity query), and
:func:`make_record_dp` for record-level DP in a ClientApp, and SecAgg+ with distributed Skellam noise
(:class:`SecureAggregation`, :func:`secure_aggregation_mod`); how the strategy sums the uploads, a part
(:class:`Aggregation`: :class:`PlainAggregation`, :class:`SecureAggregationPart`) and the strategy's other parts
(:class:`Participation`, :class:`Bounding`, :class:`Noise`, :class:`ServerStepPart`, :class:`Accounting`); what a
run keeps around the strategy's rounds (:class:`RunHook`)."""

from typing import TYPE_CHECKING

from fedprivacy.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from fedprivacy.fl.aggregation import Aggregation, PlainAggregation, SecureAggregationPart
    from fedprivacy.fl.hooks import RunHook
    from fedprivacy.fl.parts import Accounting, Bounding, Noise, Participation, ServerStepPart
    from fedprivacy.fl.mods import answer_identity_query, client_noise_mod, topk_uplink_mod
    from fedprivacy.fl.record_dp import make_record_dp
    from fedprivacy.fl.secure_aggregation import SecureAggregation, secure_aggregation_mod
    from fedprivacy.fl.strategy import DPFedAvg

__all__ = ["DPFedAvg", "answer_identity_query", "client_noise_mod", "make_record_dp", "SecureAggregation", "secure_aggregation_mod", "topk_uplink_mod",
           "Aggregation", "PlainAggregation", "SecureAggregationPart",
           "RunHook", "Participation", "Bounding", "Noise", "ServerStepPart", "Accounting"]

EXPORTS = {
    # name -> the module defining it; fedprivacy's top level exports these too
    "DPFedAvg": "fedprivacy.fl.strategy",
    "answer_identity_query": "fedprivacy.fl.mods",
    "client_noise_mod": "fedprivacy.fl.mods",
    "make_record_dp": "fedprivacy.fl.record_dp",
    "SecureAggregation": "fedprivacy.fl.secure_aggregation",
    "secure_aggregation_mod": "fedprivacy.fl.secure_aggregation",
    "topk_uplink_mod": "fedprivacy.fl.mods",
    "Aggregation": "fedprivacy.fl.aggregation",
    "PlainAggregation": "fedprivacy.fl.aggregation",
    "SecureAggregationPart": "fedprivacy.fl.aggregation",
    "RunHook": "fedprivacy.fl.hooks",
    "Participation": "fedprivacy.fl.parts",
    "Bounding": "fedprivacy.fl.parts",
    "Noise": "fedprivacy.fl.parts",
    "ServerStepPart": "fedprivacy.fl.parts",
    "Accounting": "fedprivacy.fl.parts",
}
__getattr__ = lazy_exports(__name__, EXPORTS)
