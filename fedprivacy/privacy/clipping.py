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
    norm = float(torch.linalg.vector_norm(update))
    if norm > clip_norm:
        update.mul_(clip_norm / norm)
    return norm
