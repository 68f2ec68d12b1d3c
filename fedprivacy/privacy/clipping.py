"""Flat L2 clipping of the transmitted update (ARCHITECTURE invariant 1), exact to the last bit.

.. math:: \\operatorname{clip}(u, C) = u \\cdot \\min\\left(1, \\frac{C'}{\\lVert u \\rVert_2}\\right),
          \\qquad C' = C\\,(1 - 2^{-20})

over ALL coordinates of the vector a client actually sends, so the per-user L2 sensitivity of
the sum is C. No ``+1e-6`` fudge: a zero update stays zero (the scale is 1 when ``||u|| <= C'``).

Exactness. A float32 sum of squares can be fooled: entries whose squares vanish beside a few large
ones in the running sum (``1.018 C`` slips through a float32 clip at ``d = 5,000,500``). So the clip
uses a rigorous UPPER BOUND on the exact norm (:func:`l2_norm_bound`): float32 norms of chunks of
``K = 512`` values, squared and summed in float64 (exact for float32 inputs), inflated by the
worst-case float32 error of a ``K``-term sum of squares in ANY order, ``(K + 4) 2^-24`` relative,
plus ``2^-149`` per value for squares lost to underflow. That costs about 1.2x a plain float32 norm
(a float64 norm costs 4x, ~12% of a round of the tag model). The clip then aims at ``C' = C (1 - 2^-20)``:
the margin absorbs the float32 rounding of the scale and of each scaled value, so the clipped vector's
exact L2 norm is ``<= C``. The bound exceeds the exact norm by at most ~1.6e-5 relative, so a
clipped update is scaled by that much more than a float64 clip would: a conservative change in the
sixth digit.

References: McMahan et al. 2018, arXiv:1710.06963v3, Alg. 1 (``ClipFn``).
"""

from __future__ import annotations

import math

import torch

CLIP_MARGIN = 2.0**-20
"""Relative slack below C that absorbs the float rounding of the scaled values (module docstring)."""

_CHUNK = 512
_CHUNK_ERROR = (_CHUNK + 4) * 2.0**-24  # relative error bound of a float32 sum of _CHUNK squares, any order
_UNDERFLOW = 2.0**-149  # per value: the most a float32 square can lose to underflow


def _float64_bound(values: torch.Tensor) -> float:
    """The float64 norm inflated by its own worst-case rounding, ``(n + 4) 2^-53`` relative (for small,
    non-float32 or float32-overflowing inputs; ``inf``/``nan`` iff Inf/NaN present)."""
    return float(torch.linalg.vector_norm(values, dtype=torch.float64)) * (1.0 + (values.numel() + 4) * 2.0**-53)


def l2_norm_bound(values: torch.Tensor) -> float:
    """An upper bound on the exact ``||values||_2``, at most ~1.6e-5 above it (module docstring); ``nan``
    when NaN is present, ``inf`` when Inf is."""
    flat = values.reshape(-1)
    n = flat.numel()
    head = n - n % _CHUNK
    if values.dtype != torch.float32 or head == 0:
        return _float64_bound(values)
    chunks = torch.linalg.vector_norm(flat[:head].view(-1, _CHUNK), dim=1)
    squares = float(chunks.double().square().sum())
    if not math.isfinite(squares):  # NaN/Inf present, or a square overflowed float32: decide in float64
        return _float64_bound(values)
    tail = _float64_bound(flat[head:])
    return math.sqrt(squares * (1.0 + _CHUNK_ERROR) + tail * tail + head * _UNDERFLOW)


def clip_scale(norm: float, clip_norm: float) -> float:
    """``min(1, C' / norm)`` with ``C' = C (1 - 2^-20)``: the factor that clips a vector of L2 norm
    ``norm`` to at most C exactly (0 for an infinite norm, 1 for NaN: callers reject NaN first)."""
    target = clip_norm * (1.0 - CLIP_MARGIN)
    return target / norm if norm > target else 1.0


def float32_exact_scale(values: torch.Tensor, scale: float) -> tuple[torch.Tensor, float]:
    """``(v, a)`` with ``a * v = scale * values`` up to one float32 rounding per value. A scale below
    ``2^-120`` (only for updates of norm ~1e36 and more) would become an inexact subnormal float32
    factor, so it is applied here in float64 instead (``a = 1``)."""
    if 0.0 < scale < 2.0**-120:
        return (values.double() * scale).to(values.dtype), 1.0
    return values, scale


def flat_l2_clip_(update: torch.Tensor, clip_norm: float) -> float:
    """Clip a flat update in place to L2 norm at most ``clip_norm``; return its norm (bound) BEFORE clipping.

    Args:
        update: tensor holding every transmitted coordinate; modified in place.
        clip_norm: C > 0.

    Returns:
        :func:`l2_norm_bound` of ``update`` before clipping (``inf``/``nan`` are returned as computed).
    """
    norm = l2_norm_bound(update)
    scaled, scale = float32_exact_scale(update, clip_scale(norm, clip_norm))
    if scaled is not update:
        update.copy_(scaled)
    elif scale != 1.0:
        update.mul_(scale)
    return norm
