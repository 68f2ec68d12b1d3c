r"""Adaptive clipping to a target quantile of the update norms (ARCHITECTURE invariant 7).

Each round the server also releases a privatized fraction of unclipped updates and moves the
clip norm geometrically toward the target quantile ``gamma``:

.. math::
    \tilde b_t &= \frac{1}{m}\Big(\sum_{i \in S_t} \big(\mathbb 1[\lVert u_i\rVert \le C_t] - \tfrac12\big)
                 + \mathcal N(0, \sigma_b^2)\Big) + \tfrac12 \\
    C_{t+1} &= C_t \exp\big(-\eta_C (\tilde b_t - \gamma)\big)

The centred bits have sensitivity 1/2, so (Andrew et al., Thm. 1) releasing the clipped sum with
noise multiplier ``z_value`` together with the count is exactly one Gaussian mechanism with

.. math:: z = \big(z_{\mathrm{value}}^{-2} + (2\sigma_b)^{-2}\big)^{-1/2}
          \iff z_{\mathrm{value}} = \big(z^{-2} - (2\sigma_b)^{-2}\big)^{-1/2},

so the value noise is inflated to ``z_value`` and the round is accounted as a Gaussian with the
configured ``z`` (the same epsilon as a fixed-clip run). This needs ``z < 2 sigma_b``; otherwise
the configuration is rejected. ``sigma_b`` defaults to ``m / 20`` (TFF's ``0.05 * clients``).
The divisor is the EXPECTED cohort ``m`` (TFF's ``expected_num_records``), never the realized one.

Symbols: ``target_quantile`` = gamma, ``learning_rate`` = eta_C, ``count_stddev`` = sigma_b.
References: Andrew et al. 2021, arXiv:1905.03871v5, Alg. 1 and Thm. 1; TFF
``QuantileEstimatorQuery`` / ``adaptive_clip_noise_params``.
"""

from __future__ import annotations

import math

import torch

from fedprivacy.privacy.noise import GaussianNoise


def value_noise_multiplier(noise_multiplier: float, count_stddev: float) -> float:
    """``z_value`` such that the value and count releases compose to ``noise_multiplier``."""
    if noise_multiplier == 0.0:
        return 0.0
    if noise_multiplier >= 2.0 * count_stddev:
        raise ValueError(
            f"privacy.noise_multiplier={noise_multiplier} must be below 2 * clipped_count_stddev = "
            f"{2.0 * count_stddev} for adaptive clipping (raise clipped_count_stddev or lower the multiplier)"
        )
    return (noise_multiplier**-2 - (2.0 * count_stddev) ** -2) ** -0.5


class AdaptiveClip:
    """The clip norm ``C_t`` and its privatized geometric quantile update."""

    def __init__(self, initial_clip_norm: float, *, target_quantile: float, learning_rate: float,
                 count_stddev: float, expected_cohort: float) -> None:
        self.clip_norm = initial_clip_norm
        self.target_quantile = target_quantile
        self.learning_rate = learning_rate
        self.count_stddev = count_stddev
        self.expected_cohort = expected_cohort

    def update_(self, unclipped: int, accepted: int, noise: GaussianNoise, noise_free: bool = False) -> float:
        """Release the noised unclipped fraction of this round and move ``C``; return the fraction.

        Args:
            unclipped: accepted updates with norm <= C_t.
            accepted: updates that entered the sum (rejected ones contribute zero to both releases).
            noise: the mechanism's dedicated generator (one scalar draw).
            noise_free: ``True`` when the run has noise multiplier 0 (no privacy): no count noise.
        """
        centred = torch.tensor([unclipped - accepted / 2.0], dtype=torch.float64, device=noise.device)
        if not noise_free:
            noise.add_(centred, self.count_stddev)
        fraction = float(centred[0]) / self.expected_cohort + 0.5
        self.clip_norm *= math.exp(-self.learning_rate * (fraction - self.target_quantile))
        return fraction

    def state_dict(self) -> dict:
        return {"clip_norm": self.clip_norm}

    def load_state_dict(self, state: dict) -> None:
        self.clip_norm = float(state["clip_norm"])
