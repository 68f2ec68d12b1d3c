"""Flat L2 clipping of the transmitted update (ARCHITECTURE invariant 1).

.. math:: \\operatorname{clip}(u, C) = u \\cdot \\min\\left(1, \\frac{C}{\\lVert u \\rVert_2}\\right)

over ALL coordinates of the vector a client actually sends, so the per-user L2 sensitivity of
the sum is C. No ``+1e-6`` fudge: a zero update stays zero (the scale is 1 when ``||u|| <= C``).

References: McMahan et al. 2018, arXiv:1710.06963v3, Alg. 1 (``ClipFn``).
"""

from __future__ import annotations

import torch


def flat_l2_clip_(update: torch.Tensor, clip_norm: float) -> float:
    """Clip a flat update in place to L2 norm ``clip_norm``; return its norm BEFORE clipping.

    Args:
        update: 1-D tensor holding every transmitted coordinate; modified in place.
        clip_norm: C > 0.

    Returns:
        ``||update||_2`` before clipping (a float; ``inf``/``nan`` are returned as computed).
    """
    norm, scale = l2_clip_scale(update, clip_norm)
    if scale != 1.0:
        update.mul_(scale)
    return norm


def l2_clip_scale(update: torch.Tensor, clip_norm: float) -> tuple[float, float]:
    """``(||update||_2, min(1, C / ||update||_2))`` without touching ``update``: ``clip(u, C) = scale * u``.

    For a consumer that folds the scale into its accumulation (``sum += scale * u``) and so never
    writes to the update (which may be a read-only view over a received message).
    """
    norm = float(torch.linalg.vector_norm(update))
    return norm, clip_scale(norm, clip_norm)


def clip_scale(norm: float, clip_norm: float) -> float:
    """``min(1, C / norm)``: the factor that clips a vector of L2 norm ``norm`` (0 for an infinite norm)."""
    return clip_norm / norm if norm > clip_norm else 1.0
