r"""Uplink compression with error feedback: DP-MicroAdam's top-k and 4-bit residual on the client.

Round ``t`` on client ``i`` (DP-MicroAdam's error feedback and top-k, arXiv:2511.20509, Alg. 1 lines 8-13
and Alg. 2's Q, Q⁻¹, applied to the client's update: the paper has no federated setting), with the
residual :math:`e_i` kept on the client across rounds (also the rounds it sits out; zero before its first):

.. math::
    a &= \Delta_i + Q^{-1}(e_i) \\
    e_i &\leftarrow Q\big(a - T_k(a)\big) \\
    s &= \mathrm{clip}\big(T_k(a), C\big) \qquad \text{(transmitted: k coordinates)}

:math:`T_k` keeps the ``k = ceil(density * d)`` entries of largest magnitude (global) or
``ceil(density * n_p)`` of each parameter tensor (the paper code), ``C`` is the round's clip norm,
and ``Q`` is the bucketed 4-bit min-max quantiser (or none). Error-feedback conservation: the
selected part plus the new residual is exactly what the client owed,
:math:`T_k(a) + (a - T_k(a)) = \Delta_i + Q^{-1}(e_i)`, up to ``Q``'s rounding of the residual (at
most half a quantisation step per coordinate, or unbiased with stochastic rounding). The residual
carries the COMPRESSION error only; what the clip removes is dropped, as in DP-FedAvg, so with
density 1 and no quantisation the upload is exactly ``clip(Delta_i, C)``. The clip bounds what is
SENT, not the pre-feedback delta (whose norm says nothing about :math:`\lVert a \rVert`), so the
server's own clip at C never changes it.

Privacy: user-level DP needs only that each round's contribution of a user has norm at most C and
that the server adds dense noise over ALL d coordinates (it does: noise on the untransmitted
coordinates hides which ones were selected). The residual is a client's private state, never sent;
conditioned on the released models each round's upload is still a bounded contribution, so the
subsampled Gaussian accounting of DP-FedAvg holds unchanged. Client-side noise (local or
distributed placements) would have to precede the data-dependent top-k, so compression is refused
with them (config).

Everything a client needs fits in flat COO: a delta on the client's support (block-sparse rows of
the word-indexed weight, a flat list, or dense) becomes sorted coordinates and values; the residual
holds only the coordinates it is non-zero on (for plain local SGD, within the client's own support).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np
import torch

from fedprivacy.optim.microadam import dequantize_4bit, quantize_4bit, top_k_per_block
from fedprivacy.privacy.clipping import clip_scale, float32_exact_scale, l2_norm_bound
from fedprivacy.updates import SparseUpdate


@dataclass(frozen=True)
class Residual:
    """A client's error feedback ``e``: flat coordinates and, stored, float32 values or 4-bit codes."""

    indices: np.ndarray
    """int32, strictly increasing."""
    values: np.ndarray | None = None
    codes: np.ndarray | None = None
    mins: np.ndarray | None = None
    scales: np.ndarray | None = None
    bucket_size: int = 0

    def dequantized(self) -> torch.Tensor:
        """:math:`Q^{-1}(e)` on :attr:`indices` (float32)."""
        if self.values is not None:
            return torch.from_numpy(self.values)
        return dequantize_4bit(torch.from_numpy(self.codes), torch.from_numpy(self.mins),
                               torch.from_numpy(self.scales), len(self.indices), self.bucket_size)

    @property
    def nbytes(self) -> int:
        """Bytes the client stores (indices + values, or + codes and the per-bucket ranges)."""
        return sum(a.nbytes for a in (self.indices, self.values, self.codes, self.mins, self.scales) if a is not None)

    def to_arrays(self) -> dict[str, np.ndarray]:
        """Plain arrays (for a Flower ``ArrayRecord`` in ``Context.state``)."""
        if self.values is not None:
            return {"indices": self.indices, "values": self.values}
        return {"indices": self.indices, "codes": self.codes, "mins": self.mins, "scales": self.scales,
                "bucket_size": np.array([self.bucket_size], dtype=np.int64)}

    @classmethod
    def from_arrays(cls, arrays: dict[str, np.ndarray]) -> Residual:
        """Inverse of :meth:`to_arrays`. Values, codes and ranges are copied: a record's arrays are
        read-only views, which torch cannot wrap without a warning (indices are widened, a copy anyway)."""
        if "values" in arrays:
            return cls(np.asarray(arrays["indices"]), values=np.array(arrays["values"], dtype=np.float32))
        return cls(np.asarray(arrays["indices"]), codes=np.array(arrays["codes"]), mins=np.array(arrays["mins"]),
                   scales=np.array(arrays["scales"]), bucket_size=int(arrays["bucket_size"][0]))


@dataclass(frozen=True)
class Compressed:
    """One round's upload and what the client keeps."""

    sent: SparseUpdate
    residual: Residual | None
    """None when nothing is left over (every owed coordinate was selected)."""
    owed_norm: float
    """:math:`\\lVert a \\rVert_2`, for diagnostics."""


def flat_coo(update: SparseUpdate) -> tuple[torch.Tensor, torch.Tensor]:
    """``(indices, values)`` of ``update`` as flat sorted coordinates (dense: every coordinate)."""
    values = update.values.detach().to("cpu", torch.float32)
    if update.indices is None:
        return torch.arange(update.dim), values.reshape(-1)
    if update.block == 1:
        return update.indices.cpu(), values
    b = update.block
    return (update.indices.cpu()[:, None] * b + torch.arange(b)).reshape(-1), values.reshape(-1)


def _owed(update: SparseUpdate, residual: Residual | None) -> tuple[torch.Tensor, torch.Tensor]:
    """:math:`a = \\Delta + Q^{-1}(e)` in flat COO over the union of both supports."""
    idx, val = flat_coo(update)
    if residual is None or len(residual.indices) == 0:
        return idx, val
    r_idx = torch.from_numpy(residual.indices.astype(np.int64))
    if len(idx):  # common case (local SGD on the same rows): the residual lies inside the delta's support
        pos = torch.searchsorted(idx, r_idx)
        if bool((pos < len(idx)).all()) and torch.equal(idx[pos], r_idx):
            return idx, val.clone().index_add_(0, pos, residual.dequantized())
    both = torch.cat([idx, r_idx])
    union, where = torch.unique(both, sorted=True, return_inverse=True)
    owed = torch.zeros(len(union), dtype=torch.float32).index_add_(0, where, torch.cat([val, residual.dequantized()]))
    return union, owed


def _top_k(indices: torch.Tensor, values: torch.Tensor, density: float,
           tensor_sizes: Sequence[int] | None, dim: int) -> torch.Tensor:
    """Positions (into ``values``, increasing) of the top-k magnitudes: ``ceil(density * dim)`` overall, or
    ``ceil(density * n_p)`` within each parameter tensor's coordinates (``tensor_sizes``, in flat order)
    (:func:`~fedprivacy.optim.microadam.top_k_per_block` over the entries each tensor holds)."""
    if tensor_sizes is None:
        return top_k_per_block(values, [len(values)], [math.ceil(density * dim)])
    bounds = torch.tensor([0, *np.cumsum(tensor_sizes)], dtype=torch.int64)
    cuts = torch.searchsorted(indices, bounds).tolist()
    return top_k_per_block(values, [hi - lo for lo, hi in zip(cuts, cuts[1:])],
                           [math.ceil(density * n) for n in tensor_sizes])


def compress(update: SparseUpdate, residual: Residual | None, *, density: float, clip_norm: float,
             quantization: str = "4bit", bucket_size: int = 100_000, tensor_sizes: Sequence[int] | None = None,
             generator: torch.Generator | None = None) -> Compressed:
    """One round of the module docstring's scheme: the upload :math:`s` and the new residual :math:`Q(a - T_k(a))`.

    Args:
        update: the client's delta :math:`\\Delta_i` (any :class:`SparseUpdate` form).
        residual: :math:`e_i` from the client's state, or None (zero).
        density: k / d.
        clip_norm: C of this round (the server clips again at C; a no-op on ``s``).
        quantization: ``"none"``, ``"4bit"`` (round to nearest) or ``"4bit_stochastic"``.
        bucket_size: entries per quantisation range.
        tensor_sizes: the model's parameter sizes in flat order for per-tensor top-k, or None (global).
        generator: the stochastic rounding's source (its own stream per client and round).

    Returns:
        :class:`Compressed`: ``sent`` is flat COO (float32) with strictly increasing indices.
    """
    indices, owed = _owed(update, residual)
    keep = _top_k(indices, owed, density, tensor_sizes, update.dim)
    chosen = owed[keep]
    sent, scale = float32_exact_scale(chosen, clip_scale(l2_norm_bound(chosen), clip_norm))
    sent = sent * scale
    left = owed.clone()
    left[keep] = 0.0
    nonzero = left != 0
    if not bool(nonzero.any()):
        new_residual = None
    else:
        rest_idx = indices[nonzero].numpy().astype(np.int32)
        rest = left[nonzero]
        if quantization == "none":
            new_residual = Residual(rest_idx, values=rest.numpy())
        else:
            codes, mins, scales = quantize_4bit(rest, bucket_size, quantization == "4bit_stochastic", generator)
            new_residual = Residual(rest_idx, codes=codes.numpy(), mins=mins.numpy(), scales=scales.numpy(),
                                    bucket_size=bucket_size)
    return Compressed(SparseUpdate(indices[keep], sent, update.dim), new_residual,
                      float(torch.linalg.vector_norm(owed)))
