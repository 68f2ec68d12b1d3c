r"""Client mods for any Flower ClientApp: client-side clipping with distributed or local noise, and
top-k uplink compression with error feedback; the answer to the strategy's identity query; and the two
uploads as functions of a client's delta, which fedprivacy's own ClientApp and the cohort engine call too
(one implementation of each step).

.. code-block:: python

    app = ClientApp(mods=[client_noise_mod(placement="distributed", noise_multiplier=1.0, clip_norm=1.0,
                                           expected_cohort=10)])

The wrapped ClientApp trains as it always does and replies its full weights ``w_i`` (Flower's
convention). The mod turns that into the privatized upload of :mod:`fedprivacy.privacy.placement`:

.. math:: w_i' = x_t + \operatorname{clip}(w_i - x_t, C) + \mathcal N(0, s^2 I_d), \qquad
          s = zC/\sqrt m \ (\text{distributed}) \ \text{or}\ zC \ (\text{local})

over every float32 array the server sent, so the server (``DPFedAvg(placement=...)``, which then does
not clip) sums shares that carry the full noise ``N(0, z^2 C^2)``. The noise comes from the OS's
cryptographic source, never from a seed the server knows or sets: a device's noise protects it from
the server only if the server cannot rebuild it.

The server is not trusted under these placements, so the reply carries only what it needs: the noisy
``arrays`` and, when the wrapped app reported one, the record-level DP event
(:func:`~fedprivacy.privacy.client_ledgers.event_metrics`, without its derived ``epsilon``), which
``DPFedAvg(record_level=True)`` accounts. Everything else the wrapped app put in its reply (training
loss, example counts, other records) stays on the device: each such value is a function of the
client's data released without noise.

:func:`noised_upload` and :func:`compressed_upload` are these mods' math on a delta
:math:`\Delta_i` (any :class:`~fedprivacy.updates.SparseUpdate`). fedprivacy's ClientApp
(:func:`fedprivacy.fl.client_app.client_reply`, also the reply of each client the cohort engine trains)
calls them with its own delta, its simulation's seeded noise stream and the round's clip norm
``C_t``; its residual lives under the same :data:`RESIDUAL_KEY`.

:func:`answer_identity_query` makes a ClientApp answer the identity query (:mod:`fedprivacy.fl.population`) with
its node's ``partition-id``, which ``DPFedAvg`` with a cyclic schedule (``cyclic_poisson``, ``min_separated``) keys each user's
group by, so that a restart under other node ids keeps every user in its group.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import torch
from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp import ClientApp
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedprivacy.client.compression import Residual, compress
from fedprivacy.fl.population import IDENTITY_ACTION, identity_reply
from fedprivacy.fl.records import (arrays_to_record, arrays_to_vector, float32_arrays, record_to_arrays,
                                   update_to_record, vector_to_arrays)
from fedprivacy.updates import SparseUpdate
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.placement import Placement, client_noise_std, privatize_upload_

RESIDUAL_KEY = "fedprivacy-uplink-residual"
"""``Context.state`` key of the error-feedback residual (:func:`compressed_upload`; it never leaves the device)."""


def noised_upload(update: SparseUpdate, clip_norm: float, std: float, noise: GaussianNoise) -> SparseUpdate:
    r"""The DENSE upload :math:`\operatorname{clip}(u, C) + \mathcal N(0, s^2 I_d)` of ``update`` (left as it is):
    :func:`~fedprivacy.privacy.placement.privatize_upload_` on a copy, ``std`` :math:`= s` drawn from ``noise``."""
    return SparseUpdate.dense(privatize_upload_(update.to_dense().clone(), clip_norm, std, noise))


def compressed_upload(update: SparseUpdate, state: RecordDict, **settings: Any) -> tuple[SparseUpdate, int]:
    r"""The upload :math:`s = \operatorname{clip}(T_k(a), C)` of :math:`a = \Delta + e`, with the node's residual
    :math:`e` read from ``state[RESIDUAL_KEY]`` (zero when absent) and replaced there by
    :math:`e \leftarrow Q(a - T_k(a))` (removed when nothing is left over).

    :func:`fedprivacy.client.compression.compress` is the math (DP-MicroAdam's uplink, arXiv:2511.20509,
    Alg. 1 lines 8-13); ``settings`` are its keyword arguments (``density``, ``clip_norm``, ``quantization``, ...).
    Returns :math:`s` (flat COO) and the bytes the new residual takes on the device.
    """
    held = state.array_records.get(RESIDUAL_KEY)
    out = compress(update, None if held is None else Residual.from_arrays(record_to_arrays(held)), **settings)
    if out.residual is not None:
        state[RESIDUAL_KEY] = arrays_to_record(out.residual.to_arrays())
    elif held is not None:
        del state[RESIDUAL_KEY]
    return out.sent, 0 if out.residual is None else out.residual.nbytes


def _weights_delta(msg: Message, reply: Message) -> tuple[dict[str, np.ndarray], torch.Tensor, torch.Tensor]:
    """The broadcast's float32 arrays, :math:`x_t` flat, and :math:`w_i - x_t` of a full-weights reply."""
    sent = float32_arrays(msg.content.array_records["arrays"])
    start = arrays_to_vector(sent)
    return sent, start, arrays_to_vector(float32_arrays(reply.content.array_records["arrays"])) - start


def client_noise_mod(*, placement: Placement, noise_multiplier: float, clip_norm: float,
                     expected_cohort: int) -> Mod:
    """A mod that clips the client's update to ``clip_norm`` and adds its noise (module docstring)."""
    if placement not in ("distributed", "local"):
        raise ValueError(f"placement must be 'distributed' or 'local' for a client mod, got {placement!r}")
    std = client_noise_std(placement, noise_multiplier, clip_norm, expected_cohort)

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        from fedprivacy.privacy.client_ledgers import METRIC_PREFIX  # here: fedprivacy's ClientApp imports no accountant

        sent, start, delta = _weights_delta(msg, reply)
        upload = noised_upload(SparseUpdate.dense(delta), clip_norm, std, GaussianNoise(0, secure=True))
        content = RecordDict({"arrays": arrays_to_record(vector_to_arrays(start + upload.values, sent))})
        event = {k: v for k, v in (reply.content.metric_records.get("metrics") or {}).items()
                 if k.startswith(METRIC_PREFIX) and k != f"{METRIC_PREFIX}epsilon"}
        if event:
            content["metrics"] = MetricRecord(event)
        reply.content = content
        return reply

    return mod


def answer_identity_query(app: ClientApp) -> ClientApp:
    """Register on ``app`` the answer to the identity query (module docstring): its node config's ``partition-id``."""

    @app.query(IDENTITY_ACTION)
    def identity(msg: Message, context: Context) -> Message:
        return identity_reply(int(context.node_config["partition-id"]), msg)

    return app


def topk_uplink_mod(*, density: float, clip_norm: float, quantization: str = "none",
                    per_tensor: bool = False) -> Mod:
    r"""A mod that sends ``clip(T_k(Delta + e), C)`` as a sparse delta and keeps ``e`` in ``Context.state``.

    :func:`compressed_upload` of ``Delta = w_i - x_t``: the ``k = ceil(density d)`` largest entries of
    ``a = Delta + e`` (per parameter tensor with ``per_tensor``) are sent, clipped to ``clip_norm`` (the
    server's C, so its clip never changes them); ``e <- a - T_k(a)`` (4-bit quantized with
    ``quantization="4bit"``). The reply's ``arrays`` become fedprivacy's sparse delta
    ``{"indices", "values"}``, which ``DPFedAvg`` accepts; use it with central placement (client-side
    noise would have to precede the data-dependent top-k).
    """

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        sent, _, delta = _weights_delta(msg, reply)
        upload, _ = compressed_upload(SparseUpdate.dense(delta), context.state, density=density, clip_norm=clip_norm,
                                      quantization=quantization,
                                      tensor_sizes=[a.size for a in sent.values()] if per_tensor else None)
        reply.content["arrays"] = update_to_record(upload)
        return reply

    return mod
