"""A client's update on its way to the private sum, and why a reply contributes nothing.

:class:`SparseUpdate` is what clients produce (:mod:`fedprivacy.client`), replies decode to
(:mod:`fedprivacy.fl.records`) and :class:`~fedprivacy.privacy.aggregation.PrivateSum` adds;
:class:`RejectedUpdate` names the reason (:data:`REJECTION_REASONS`) a reply counts as zero. No
fedprivacy imports: every layer may use these types.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class SparseUpdate:
    """A flat update of dimension ``dim`` that is zero outside ``indices`` (``None``: dense).

    ``values`` 1-D: flat COO, ``values[j]`` is coordinate ``indices[j]``. ``values`` 2-D of shape
    ``(r, b)``: block-sparse, the flat vector viewed as ``(dim / b, b)`` rows, ``values[j]`` is row
    ``indices[j]`` (``b = 1`` is flat COO). The same vector either way; blocks make validation and
    accumulation O(r) row operations instead of O(r b) scattered ones (a logistic-regression client
    changes whole weight rows: see ``SparseLogisticRegression.support_blocks``).
    """

    indices: torch.Tensor | None
    values: torch.Tensor
    dim: int

    @classmethod
    def dense(cls, vector: torch.Tensor) -> SparseUpdate:
        return cls(None, vector.reshape(-1), vector.numel())

    @property
    def block(self) -> int:
        """Coordinates per index: 1 for flat COO and dense, ``values.shape[1]`` for blocks."""
        return int(self.values.shape[1]) if self.values.dim() == 2 else 1

    def is_well_formed(self, dim: int) -> bool:
        """Right dimension; indices 1-D int64, strictly increasing, in ``[0, dim / block)``, one value (row) each."""
        if self.dim != dim or self.values.dim() not in (1, 2):
            return False
        if self.indices is None:
            return self.values.dim() == 1 and self.values.numel() == dim
        idx, block = self.indices, self.block
        if block < 1 or dim % block or idx.dtype != torch.int64 or idx.dim() != 1 or idx.numel() != self.values.shape[0]:
            return False
        if idx.numel() == 0:
            return True
        ids = idx.cpu().numpy()  # checked in numpy: three small torch ops cost ~4x as much per reply
        return bool(ids[0] >= 0 and ids[-1] < dim // block and (ids[1:] > ids[:-1]).all())

    def to_dense(self) -> torch.Tensor:
        if self.indices is None:
            return self.values
        out = torch.zeros(self.dim, dtype=self.values.dtype, device=self.values.device)
        out.view(-1, self.block)[self.indices] = self.values.reshape(-1, self.block)
        return out


REJECTION_REASONS = ("failed", "malformed", "dtype", "nonfinite", "unaccounted")
"""Why a reply contributes zero: the client reported an error; its record is not an update of the
contract (keys, shape, dimension, indices); its payload's dtype or byte order is not the contract's
(or not what its own metadata says); it holds NaN/Inf; it trained with sample-level DP but sent no
valid accounting event."""


class RejectedUpdate(ValueError):
    """A reply that contributes zero, with its reason (one of :data:`REJECTION_REASONS`)."""

    def __init__(self, reason: str, detail: str) -> None:
        if reason not in REJECTION_REASONS:
            raise ValueError(f"unknown rejection reason {reason!r}")
        super().__init__(detail)
        self.reason = reason
