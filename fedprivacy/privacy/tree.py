r"""DP-FTRL's online tree aggregation with the efficient (Honaker) estimator (Kairouz et al. 2021,
arXiv:2103.00039, §3 and App. B.1; Honaker 2015).

The strategy: a binary tree over the ``n`` releases of a horizon; every node, once complete, is released
with fresh noise :math:`\sigma s\, u_v`. The efficient estimate of a node at level ``l`` (covering
:math:`2^l` releases) combines its own noise with its children's estimates by inverse variance,

.. math::
    e_v = \frac{2 v_{l-1}\, u_v + (e_{\text{left}} + e_{\text{right}})}{2 v_{l-1} + 1}, \qquad
    v_l = \frac{2 v_{l-1}}{1 + 2 v_{l-1}} = \frac{2^l}{2^{l+1} - 1},\ v_0 = 1,

(bottom-up: only completed subtrees are used online). The noise of prefix sum ``t`` is the sum of the
estimates of the complete nodes of ``t``'s binary decomposition, :math:`P_t`; release ``t`` carries
:math:`P_t - P_{t-1}`. Memory: one pending estimate per level (``floor(log2 n) + 1`` model-sized vectors). The tree restarts every ``n`` releases (Kairouz et al., "restarts").

Sensitivity: one participation touches one node per level, ``L = floor(log2 n) + 1`` nodes:
:math:`s = \sqrt{L}` (exact). ``k`` participations ``b`` apart put at most :math:`c_l = \min(k, \lceil 2^l/b
\rceil)` of them in one level-``l`` node and ``k`` in all at that level, so
:math:`s^2 \le \sum_l (\lfloor k/c_l\rfloor c_l^2 + (k \bmod c_l)^2)` (an upper bound for ``k > 1``;
:func:`tree_sensitivity`). Accounted without amplification (one Gaussian event per horizon).

Release ``t``'s noise depends only on the node completed at ``t`` (level = the trailing zeros of ``t``):
its variance :func:`release_variance` is computed exactly from the estimator's weights.
"""

from __future__ import annotations

import functools
import math
from typing import Any

import numpy as np
import torch

from fedprivacy.privacy.matrix_factorization import CorrelatedNoise


def level_variance(level: int) -> float:
    """``v_l = 2^l / (2^{l+1} - 1)``: the efficient estimate's variance at ``level`` (units of a node's own)."""
    return 2.0 ** level / (2.0 ** (level + 1) - 1.0)


def _estimate_weights(level: int) -> np.ndarray:
    """Weights of the efficient estimate of a level-``level`` node over its subtree's own noises, laid out
    ``[own, left subtree, right subtree]`` recursively (``2^(level+1) - 1`` entries)."""
    if level == 0:
        return np.ones(1)
    v = level_variance(level - 1)
    child = _estimate_weights(level - 1) / (2 * v + 1)
    return np.concatenate([[2 * v / (2 * v + 1)], child, child])


@functools.lru_cache(maxsize=64)
def release_variance(level: int) -> float:
    r"""Variance (units of a node's own) of :math:`P_t - P_{t-1}` when the node completed at ``t`` has ``level``:
    its estimate minus the estimates of the complete subtrees it merges (its left child, its right child's
    left child, ..., down to level 0)."""
    weights = _estimate_weights(level)
    offset, size = 0, len(weights)
    for sub in range(level - 1, -1, -1):  # descend: left child at level ``sub``, then continue to the right
        block = 2 ** (sub + 1) - 1
        left = offset + 1
        weights[left:left + block] -= _estimate_weights(sub)
        offset = left + block  # the right child's subtree starts here
    assert offset + 1 == size
    return float(weights @ weights)


def tree_sensitivity(horizon: int, separation: int, participations: int) -> float:
    """``s`` of the tree over ``horizon`` leaves (module docstring: exact for one participation)."""
    s2 = 0
    for level in range(int(math.floor(math.log2(horizon))) + 1):
        cap = min(participations, -(-2 ** level // separation))
        s2 += (participations // cap) * cap ** 2 + (participations % cap) ** 2
    return math.sqrt(s2)


def _trailing_zeros(t: int) -> int:
    return (t & -t).bit_length() - 1


class TreeNoise(CorrelatedNoise):
    """Online tree aggregation noise with the efficient estimator (module docstring), as a noise stream."""

    kind = "tree"

    def __init__(self, seed: int, *, device: str | torch.device = "cpu", secure: bool = False, horizon: int,
                 separation: int) -> None:
        super().__init__(seed, device=device, secure=secure, horizon=horizon, separation=separation)
        self.sensitivity = tree_sensitivity(horizon, separation, self.participations)
        self._levels = int(math.floor(math.log2(horizon))) + 1

    def _row_norm(self, t: int) -> float:
        return math.sqrt(release_variance(_trailing_zeros(t)))

    def _coefficients(self) -> dict[str, Any]:
        """``C`` has one row per node, in the order their noise is drawn (leaf ``t``, then the nodes completed at
        ``t`` bottom-up), ones on the releases ``first..last`` it covers; the estimate of a level-``l`` node weighs
        its own noise by ``2 v_{l-1} / (2 v_{l-1} + 1)`` (``level_variances``, module docstring)."""
        nodes = [[t - 2 ** level + 1, t] for t in range(1, self.horizon + 1) for level in range(_trailing_zeros(t) + 1)]
        return {"strategy": "binary tree: one row per node [first, last] (releases, 1-based), ones on those columns",
                "nodes": nodes, "level_variances": [level_variance(level) for level in range(self._levels)]}

    def _next(self, w: torch.Tensor, t: int) -> torch.Tensor:
        """:math:`P_t - P_{t-1}` = the estimate of the node completed at ``t`` minus the pending estimates it
        merges. Buffers: ``e_0, ..., e_{L-1}``, the pending (complete, unmerged) node of each level."""
        if not self._buffers:
            self._buffers = [torch.zeros_like(w) for _ in range(self._levels)]
        pending = self._buffers
        node, merged = w, torch.zeros_like(w)  # the leaf's estimate; the merged estimates' sum
        for level in range(_trailing_zeros(t)):  # merge with the pending left siblings, bottom-up
            v = level_variance(level)
            node = self._fresh(w).mul_(2 * v).add_(pending[level]).add_(node).div_(2 * v + 1)
            merged.add_(pending[level])
            pending[level].zero_()
        pending[_trailing_zeros(t)].copy_(node)
        return node.sub_(merged)
