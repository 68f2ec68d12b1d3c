"""Flat L2 clipping of the transmitted update (ARCHITECTURE invariant 1), with an exact norm.

.. math:: \\operatorname{clip}(u, C) = u \\cdot \\min\\left(1, \\frac{C'}{\\lVert u \\rVert_2}\\right),
          \\qquad C' = C\\,(1 - 2^{-20})

over ALL coordinates of the vector a client actually sends, so the per-user L2 sensitivity of
the sum is C. No ``+1e-6`` fudge: a zero update stays zero (the scale is 1 when ``||u|| <= C'``).

Exactness. The norm is computed in float64: the square of a float32 value is exact there, and a
float64 sum of ``d = 5 * 10^6`` squares errs by at most ``~d * 2^-53 < 10^-9`` relative (a float32
sum can be fooled by a crafted update: entries whose squares vanish beside a few large ones, which
reads ``1.018 C`` after a float32 clip at ``d = 5,000,500``). Clipping to ``C'`` instead of ``C``
leaves room for the remaining rounding: the float32 scale (``2^-24`` relative), each scaled float32
value (``2^-24``) and the float64 sum (``< 10^-9``) together stay far below the margin ``2^-20``,
so the clipped vector's exact L2 norm is ``<= C``. The margin moves a clipped update by one part in
a million.

References: McMahan et al. 2018, arXiv:1710.06963v3, Alg. 1 (``ClipFn``).
"""

from __future__ import annotations

import torch

CLIP_MARGIN = 2.0**-20
"""Relative slack below C that absorbs float rounding (see the module docstring)."""


def exact_l2_norm(values: torch.Tensor) -> float:
    """``||values||_2`` over every element, accumulated in float64 (``inf``/``nan`` iff Inf/NaN present)."""
    return float(torch.linalg.vector_norm(values, dtype=torch.float64))


def clip_scale(norm: float, clip_norm: float) -> float:
    """``min(1, C' / norm)`` with ``C' = C (1 - 2^-20)``: the factor that clips a vector of L2 norm
    ``norm`` to at most C exactly (0 for an infinite norm, 1 for NaN: callers reject NaN first)."""
    target = clip_norm * (1.0 - CLIP_MARGIN)
    return target / norm if norm > target else 1.0


def flat_l2_clip_(update: torch.Tensor, clip_norm: float) -> float:
    """Clip a flat update in place to L2 norm at most ``clip_norm``; return its norm BEFORE clipping.

    Args:
        update: tensor holding every transmitted coordinate; modified in place.
        clip_norm: C > 0.

    Returns:
        ``||update||_2`` before clipping, in float64 (``inf``/``nan`` are returned as computed).
    """
    norm = exact_l2_norm(update)
    scale = clip_scale(norm, clip_norm)
    if scale != 1.0:
        update.mul_(scale)
    return norm
