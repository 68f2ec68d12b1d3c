"""The client side of canary clients (:mod:`fedprivacy.fl.canaries`): what a canary's node sends instead of training.

Kept apart from the server side (the estimates, the accountant, the grid wrapper) so that a ClientApp, which Flower's
deployment runtime starts afresh for every message, imports none of them.
"""

from __future__ import annotations

import numpy as np
import torch
from flwr.app import ConfigRecord, Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable

from fedprivacy.client.trainer import LocalResult
from fedprivacy.fl.records import arrays_to_record, arrays_to_vector, float32_arrays, vector_to_arrays
from fedprivacy.privacy.noise import torch_seed
from fedprivacy.updates import SparseUpdate

DIRECTION_STREAM = 0x64697263  # "dirc": canary i's direction, per canary seed
CANARY_RECORD = "fedprivacy-canary"
"""The ``ConfigRecord`` in each message to a canary's node: ``seed`` (the canary seed), ``index``, ``included``,
``norm`` (``privacy.canaries.norm``)."""


def canary_direction(seed: int, i: int, dim: int) -> torch.Tensor:
    r"""Unit direction ``i`` of the canary seed ``seed`` in ``dim`` dimensions: :math:`c_i / \|c_i\|`,
    :math:`c_i \sim \mathcal N(0, I_d)` from the stream ``(seed, DIRECTION_STREAM, i)``."""
    g = torch.Generator().manual_seed(torch_seed(np.random.SeedSequence([seed, DIRECTION_STREAM, i])))
    c = torch.randn(dim, generator=g)
    return c / torch.linalg.vector_norm(c)


def canary_update(seed: int, i: int, included: bool, dim: int, clip_norm: float, norm: float) -> torch.Tensor:
    """Canary ``i``'s update: its direction at ``norm * clip_norm`` if ``included``, else zero (``norm >= 1``:
    ``privacy.canaries.norm``)."""
    return canary_direction(seed, i, dim) * (norm * clip_norm) if included else torch.zeros(dim)



def canary_result(record: ConfigRecord, dim: int, clip_norm: float) -> LocalResult:
    """What canary ``record["index"]``'s ClientApp sends instead of training (:meth:`RunCanaries.update`, from the
    :data:`CANARY_RECORD` its node's messages carry): the update then goes through the client's own pipeline (its
    noise share, local noise or SecAgg+ masking) like any client's; no loss, no examples."""
    update = canary_update(int(record["seed"]), int(record["index"]), bool(record["included"]), dim, clip_norm,
                           float(record["norm"]))
    return LocalResult(SparseUpdate.dense(update), float("nan"), 0)


def canary_mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
    r"""A Flower mod that makes a node of any ClientApp replying full weights (Flower's convention) answer as a
    canary: a ``train`` message carrying :data:`CANARY_RECORD` gets :math:`x_t + u_i` (:func:`canary_result`'s
    update :math:`u_i` on the broadcast :math:`x_t`) without calling the app, so the mods around it treat it as
    the client's trained weights: place it innermost, e.g. ``ClientApp(mods=[client_noise_mod(...), canary_mod])``
    clips and noises it as any client's (:func:`~fedprivacy.fl.mods.client_noise_mod`). Every other message goes
    to the app. fedprivacy's own ClientApp needs no mod: it answers canary messages itself."""
    record = msg.content.config_records.get(CANARY_RECORD)
    if record is None or msg.metadata.message_type != "train":
        return call_next(msg, context)
    sent = float32_arrays(msg.content.array_records["arrays"])
    start = arrays_to_vector(sent)
    update = canary_result(record, start.numel(), float(msg.content["config"]["clip-norm"])).update.to_dense()
    return Message(RecordDict({"arrays": arrays_to_record(vector_to_arrays(start + update, sent)),
                               "metrics": MetricRecord({"num-examples": 0})}), reply_to=msg)
