r"""Where the Gaussian noise is added: central, distributed or local (ARCHITECTURE "Noise placements").

Every placement releases :math:`g_t = (\sum_i \mathrm{clip}(u_i, C) + \xi_t) / m` with the fixed
divisor m (expected cohort) and a total noise :math:`\xi_t` of variance at least
:math:`\sigma^2 C^2` per coordinate, :math:`\sigma = zC`; they differ in who draws :math:`\xi_t`
and therefore whom the guarantee protects against:

- ``central`` (default): the server clips and draws :math:`\mathcal N(0, z^2C^2 I)` once. Trusted server.
- ``distributed``: each client clips its own transmitted vector and adds its share
  :math:`\mathcal N(0, z^2C^2/m\, I)` from its own generator, so m shares sum to the full noise.
  Against the server itself this assumes secure aggregation (it only ever sees the sum). When
  fewer than m shares arrive (Poisson cohorts smaller than m, dropouts, rejected replies), the
  server tops up the :math:`m - n` missing shares, :math:`\mathcal N(0, z^2C^2 (m-n)/m\, I)`, so the
  RELEASED model always carries the configured noise (invariant 11); the guarantee against the
  server then rests on those rounds' top-up and is weaker, which the round metrics record
  (``server_noise_std`` > 0). More than m shares only add noise.
- ``local``: each client clips and adds :math:`\mathcal N(0, z^2C^2 I)` to its own update; the server
  adds nothing. Each upload is then itself a Gaussian mechanism, so each client has its own
  epsilon (:func:`local_upload_event`) with no amplification by sampling (the server knows who took
  part), composed over the rounds the client took part in. The released average carries
  :math:`n z^2 C^2 \ge z^2 C^2` of noise per coordinate for n >= 1 shares, so the user-level central
  accounting with z remains valid (conservative).

In the two client-side placements the server does not clip (the uploads are already clipped and
noised: re-clipping a noised vector would remove its noise); it still rejects malformed and
non-finite uploads (invariant 12). What the server's optimizer sees is the same released average,
so every server variant stays post-processing (invariant 3). A MALICIOUS client under a client-side
placement is bounded by nothing but that validation: it can move the average arbitrarily (its own
contribution is unclipped), and under ``distributed`` it can omit its share, which lowers the noise
protecting the other users to :math:`zC\sqrt{(m-k)/m}` for k such clients, undetectably. The noise variance of one coordinate
of :math:`g_t` (DP-AdamBC's :math:`\Phi`) follows from the placement: :func:`released_noise_variance`.
"""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Literal

import torch

from fedprivacy.privacy.clipping import flat_l2_clip_
from fedprivacy.privacy.noise import GaussianNoise

if TYPE_CHECKING:
    from fedprivacy.privacy.accounting import GaussianRound

Placement = Literal["central", "distributed", "local"]


def dp_noise_variance(noise_multiplier: float, clip_norm: float, expected_cohort: float) -> float:
    r"""``Phi = (noise_multiplier * clip_norm / expected_cohort)^2``: the per-coordinate noise variance of ``g``.

    .. math:: \Phi = \big(z\,C / m\big)^2

    Args:
        noise_multiplier: z = noise std / clip_norm on the SUM of clipped updates (>= 0).
        clip_norm: C, the flat L2 clip norm (> 0).
        expected_cohort: m, the fixed divisor of the sum (> 0).

    Returns:
        Φ in the units of ``g`` squared; 0 when ``noise_multiplier`` is 0.

    Raises:
        ValueError: on a negative ``noise_multiplier`` or a non-positive ``clip_norm`` or
            ``expected_cohort``.
    """
    if noise_multiplier < 0.0:
        raise ValueError(f"noise_multiplier must be >= 0, got {noise_multiplier}")
    if not clip_norm > 0.0:
        raise ValueError(f"clip_norm must be > 0, got {clip_norm}")
    if not expected_cohort > 0.0:
        raise ValueError(f"expected_cohort must be > 0, got {expected_cohort}")
    return (noise_multiplier * clip_norm / expected_cohort) ** 2


def client_noise_std(placement: Placement, noise_multiplier: float, clip_norm: float, expected_cohort: float) -> float:
    """Std of the noise one client adds to its clipped upload: 0, ``zC / sqrt(m)`` or ``zC``."""
    if placement == "central":
        return 0.0
    if placement == "distributed":
        return noise_multiplier * clip_norm / math.sqrt(expected_cohort)
    return noise_multiplier * clip_norm


def server_noise_std(placement: Placement, noise_multiplier: float, clip_norm: float, expected_cohort: float,
                     shares_received: int) -> float:
    """Std of the server's one dense draw: ``zC`` (central), the top-up ``zC sqrt(max(0, m - n) / m)``
    for the missing shares (distributed), 0 (local)."""
    if placement == "central":
        return noise_multiplier * clip_norm
    if placement == "distributed":
        return noise_multiplier * clip_norm * math.sqrt(max(0.0, expected_cohort - shares_received) / expected_cohort)
    return 0.0


def released_noise_variance(placement: Placement, noise_multiplier: float, clip_norm: float,
                            expected_cohort: float) -> float:
    r"""Per-coordinate noise variance of :math:`g_t` in an expected round (DP-AdamBC's :math:`\Phi`).

    central and distributed (with top-up, n <= m): :math:`(zC/m)^2`; local: n shares of
    :math:`z^2C^2` divided by :math:`m^2`, with n = m expected: :math:`z^2C^2/m`.
    """
    phi = dp_noise_variance(noise_multiplier, clip_norm, expected_cohort)
    return phi * expected_cohort if placement == "local" else phi


def privatize_upload_(update: torch.Tensor, clip_norm: float, std: float, noise: GaussianNoise) -> torch.Tensor:
    """A client's upload made private in place: ``clip(u, C) + N(0, std^2 I_d)`` over the DENSE
    vector (the noise covers every coordinate, also those local training could not change)."""
    flat_l2_clip_(update, clip_norm)
    noise.add_(update, std)
    return update


def local_upload_event(noise_multiplier: float) -> GaussianRound:
    r"""The accounting event of one locally noised upload, for the client's own ledger.

    Local DP compares ANY two inputs of the client, so one upload :math:`\mathrm{clip}(u) + \mathcal
    N(0, z^2C^2)` has sensitivity 2C: a Gaussian mechanism with multiplier z / 2, not amplified by
    sampling (the server sees who uploads). :class:`~fedprivacy.privacy.client_ledgers.ClientLedgers`
    composes it over the rounds the client took part in.
    """
    from fedprivacy.privacy.accounting import GaussianRound  # dp-accounting: server side only

    return GaussianRound(noise_multiplier / 2, "none", 1, 1.0)
