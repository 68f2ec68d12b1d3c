r"""Client mods for any Flower ClientApp: client-side clipping with distributed or local noise, and
top-k uplink compression with error feedback.

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
"""

from __future__ import annotations

from flwr.app import Context, Message, MetricRecord, RecordDict
from flwr.clientapp.typing import ClientAppCallable, Mod

from fedprivacy.client.compression import Residual, compress
from fedprivacy.fl.records import (arrays_to_record, arrays_to_vector, float32_arrays, record_to_arrays,
                                   update_to_record, vector_to_arrays)
from fedprivacy.updates import SparseUpdate
from fedprivacy.privacy.client_ledgers import METRIC_PREFIX
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.placement import Placement, client_noise_std, privatize_upload_


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
        sent = float32_arrays(msg.content.array_records["arrays"])
        start = arrays_to_vector(sent)
        update = arrays_to_vector(float32_arrays(reply.content.array_records["arrays"])) - start
        privatize_upload_(update, clip_norm, std, GaussianNoise(0, secure=True))
        content = RecordDict({"arrays": arrays_to_record(vector_to_arrays(start + update, sent))})
        event = {k: v for k, v in (reply.content.metric_records.get("metrics") or {}).items()
                 if k.startswith(METRIC_PREFIX) and k != f"{METRIC_PREFIX}epsilon"}
        if event:
            content["metrics"] = MetricRecord(event)
        reply.content = content
        return reply

    return mod


RESIDUAL_KEY = "fedprivacy-uplink-residual"
"""``Context.state`` key of :func:`topk_uplink_mod`'s error-feedback residual (it never leaves the device)."""


def topk_uplink_mod(*, density: float, clip_norm: float, quantization: str = "none",
                    per_tensor: bool = False) -> Mod:
    r"""A mod that sends ``clip(T_k(Delta + e), C)`` as a sparse delta and keeps ``e`` in ``Context.state``.

    :mod:`fedprivacy.client.compression` is the math (DP-MicroAdam's uplink, notes/microadam.md §3):
    ``a = (w_i - x_t) + e``; the ``k = ceil(density d)`` largest entries of ``a`` (per parameter tensor
    with ``per_tensor``) are sent, clipped to ``clip_norm`` (the server's C, so its clip never changes
    them); ``e <- a - T_k(a)`` (4-bit quantized with ``quantization="4bit"``). The reply's ``arrays``
    become fedprivacy's sparse delta ``{"indices", "values"}``, which ``DPFedAvg`` accepts; use it with
    central placement (client-side noise would have to precede the data-dependent top-k).
    """

    def mod(msg: Message, context: Context, call_next: ClientAppCallable) -> Message:
        reply = call_next(msg, context)
        if msg.metadata.message_type != "train" or reply.has_error():
            return reply
        sent = float32_arrays(msg.content.array_records["arrays"])
        delta = arrays_to_vector(float32_arrays(reply.content.array_records["arrays"])) - arrays_to_vector(sent)
        held = context.state.array_records.get(RESIDUAL_KEY)
        residual = None if held is None else Residual.from_arrays(record_to_arrays(held))
        out = compress(SparseUpdate.dense(delta), residual, density=density, clip_norm=clip_norm,
                       quantization=quantization,
                       tensor_sizes=[a.size for a in sent.values()] if per_tensor else None)
        if out.residual is None:
            if held is not None:
                del context.state[RESIDUAL_KEY]
        else:
            context.state[RESIDUAL_KEY] = arrays_to_record(out.residual.to_arrays())
        reply.content["arrays"] = update_to_record(out.sent)
        return reply

    return mod
