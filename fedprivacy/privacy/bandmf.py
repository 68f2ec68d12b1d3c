r"""Banded matrix factorization (BandMF; Choquette-Choo et al. 2023, arXiv:2306.08153) with banded Toeplitz
coefficients, as a noise stream.

The strategy ``C`` is lower-triangular Toeplitz with ``p`` bands, :math:`c_0 = 1, c_1, \dots, c_{p-1}`.
Toeplitz rather than a general banded ``C`` (the paper's §3 optimizes all :math:`O(n p)` entries): one
optimization over ``p - 1`` numbers scales to thousands of rounds, and banded Toeplitz strategies lose almost
nothing against the general optimum for the prefix-sum workload (McMahan et al. 2024, arXiv:2408.08868, §5;
Kalinin & Lampert 2024, arXiv:2405.15913, Thm. 2 ff.). The coefficients minimize the mean squared
prefix-sum error per unit noise times the squared sensitivity,

.. math:: \min_{c_1..c_{p-1}}\ \tfrac1n \lVert A C^{-1} \rVert_F^2 \cdot k \lVert c\rVert^2

(``p <= b``: columns ``b`` apart are orthogonal, :math:`s^2 = k\lVert c\rVert^2` when they fit in ``n``), by L-BFGS in float64 from the
truncated optimal Toeplitz factor :math:`(1-x)^{-1/2}` (Fichtenberger et al. 2023, arXiv:2202.11205).

Noise: :math:`y = C^{-1} w` by streaming forward substitution,
:math:`y_t = (w_t - \sum_{i=1}^{p-1} c_i y_{t-i}) / c_0`, keeping the last ``p - 1`` vectors ``y``.

Accounting: with cyclic Poisson participation over ``b >= p`` groups, amplified: the run is DP-SGD with
``ceil(T/b)`` Poisson-subsampled Gaussian steps of multiplier ``z`` relative to the column norm (Thm. 4), the
schedule's own events; otherwise one Gaussian event per horizon at ``s = sqrt(k) ||c||``.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from fedprivacy.privacy.matrix_factorization import ToeplitzNoise, as_float64, inverse_coefficients, prefix_error


def _sqrt_factor(bands: int) -> np.ndarray:
    """Coefficients of :math:`(1-x)^{-1/2}`: :math:`\\binom{2i}{i} / 4^i`."""
    out = np.ones(bands)
    for i in range(1, bands):
        out[i] = out[i - 1] * (2 * i - 1) / (2 * i)
    return out


@functools.lru_cache(maxsize=32)
def bandmf_coefficients(horizon: int, bands: int, iterations: int = 200) -> np.ndarray:
    """The ``bands`` Toeplitz coefficients (``c_0 = 1``) minimizing the module docstring's objective for ``horizon``
    releases (float64, read-only; deterministic)."""
    if not 1 <= bands <= horizon:
        raise ValueError(f"bands must be in [1, horizon={horizon}], got {bands}")
    if bands == 1:
        return as_float64([1.0])
    free = torch.tensor(_sqrt_factor(bands)[1:], dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([free], lr=1.0, max_iter=iterations, tolerance_grad=1e-12, tolerance_change=1e-15,
                            history_size=20, line_search_fn="strong_wolfe")

    def loss() -> torch.Tensor:
        opt.zero_grad()
        c = torch.cat([torch.ones(1, dtype=torch.float64), free])
        value = prefix_error(inverse_coefficients(c, horizon)) * (c @ c)
        value.backward()
        return value

    opt.step(loss)
    return as_float64(np.concatenate([[1.0], free.detach().numpy()]))


class BandMFNoise(ToeplitzNoise):
    """Banded Toeplitz matrix factorization noise (module docstring). ``amplified``: cyclic Poisson accounting."""

    kind = "bandmf"

    def __init__(self, seed: int, *, device: str | torch.device = "cpu", secure: bool = False, horizon: int,
                 separation: int, bands: int, amplified: bool = False) -> None:
        if bands > separation:
            raise ValueError(f"privacy.mechanism.bands={bands} must be <= privacy.groups={separation} (columns of a "
                             "strategy with more bands than the min separation overlap: no exact sensitivity here)")
        super().__init__(seed, device=device, secure=secure, horizon=horizon, separation=separation,
                         coefficients=bandmf_coefficients(horizon, bands), amplified=amplified)
        self._c = [float(x) for x in self.coefficients]

    def _coefficients(self) -> dict[str, Any]:
        return {**super()._coefficients(), "bands": len(self._c)}

    def _next(self, w: torch.Tensor, t: int) -> torch.Tensor:
        """Forward substitution; buffers: ``y_{t-1}, ..., y_{t-p+1}`` (newest first)."""
        y = w
        for c, past in zip(self._c[1:], self._buffers):
            y.sub_(past, alpha=c)
        y.div_(self._c[0])
        if len(self._c) > 1:  # the oldest buffer, overwritten in place, becomes the newest (no model-sized churn)
            newest = self._buffers.pop() if len(self._buffers) == len(self._c) - 1 else torch.empty_like(y)
            self._buffers.insert(0, newest.copy_(y))
        return y
