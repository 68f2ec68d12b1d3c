r"""Buffered linear Toeplitz (BLT) mechanisms (Dvijotham et al. 2024, arXiv:2404.16706; McMahan et al. 2024,
arXiv:2408.08868), as a noise stream.

The strategy ``C`` is lower-triangular Toeplitz with :math:`c_0 = 1` and, for ``m`` buffers with decays
:math:`\theta_j \in (0, 1)` and output scales :math:`\omega_j \ge 0`,

.. math:: c_i = \sum_{j=1}^{m} \omega_j \theta_j^{\,i-1} \quad (i \ge 1).

Noise :math:`y = C^{-1} w` streams with one model-sized buffer per BLT buffer, whatever the number of rounds
(Dvijotham et al. §3): with :math:`S_{j,1} = 0`,

.. math:: y_t = w_t - \sum_j \omega_j S_{j,t}, \qquad S_{j,t+1} = \theta_j S_{j,t} + y_t,

since :math:`\sum_{i\ge1} c_i y_{t-i} = \sum_j \omega_j \sum_{i \ge 1} \theta_j^{i-1} y_{t-i}`.

The parameters minimize the mean squared prefix-sum error per unit noise times the squared sensitivity under
``b``-min-separated participation with ``k = ceil(n/b)`` participations,
:math:`\tfrac1n\lVert A C^{-1}\rVert_F^2\, s(C)^2` with :math:`s(C) = \lVert\sum_{j<k} C_{:,jb}\rVert`, exact since
the coefficients are non-negative and non-increasing (McMahan et al. 2024, Thm. 2). The parameterization keeps
them so: :math:`\theta = \operatorname{sigmoid}(\cdot)`, :math:`\omega = \operatorname{sigmoid}(\cdot)
\operatorname{softmax}(\cdot)` (hence :math:`c_1 = \sum\omega < 1 = c_0` and :math:`c_i` decreasing). L-BFGS in
float64, deterministic. Accounted without amplification: one Gaussian event per horizon.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np
import torch

from fedprivacy.privacy.matrix_factorization import (ToeplitzNoise, as_float64, inverse_coefficients,
                                                     participations, prefix_error, strided_column_sum)


def blt_coefficients(theta: np.ndarray | torch.Tensor, omega: np.ndarray | torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` Toeplitz coefficients of the BLT with decays ``theta`` and scales ``omega`` (float64)."""
    theta = torch.as_tensor(np.array(theta) if isinstance(theta, np.ndarray) else theta, dtype=torch.float64)
    omega = torch.as_tensor(np.array(omega) if isinstance(omega, np.ndarray) else omega, dtype=torch.float64)
    powers = torch.arange(n - 1, dtype=torch.float64)[:, None]
    tail = (omega * torch.exp(powers * torch.log(theta))).sum(1)
    return torch.cat([torch.ones(1, dtype=torch.float64), tail])


def blt_loss(theta: np.ndarray | torch.Tensor, omega: np.ndarray | torch.Tensor, horizon: int,
             separation: int) -> torch.Tensor:
    """The objective (module docstring) at ``theta``, ``omega`` (differentiable)."""
    c = blt_coefficients(theta, omega, horizon)
    s = strided_column_sum(c, horizon, separation, participations(horizon, separation))
    return prefix_error(inverse_coefficients(c, horizon)) * (s @ s)


@functools.lru_cache(maxsize=32)
def blt_parameters(horizon: int, buffers: int, separation: int,
                   iterations: int = 300) -> tuple[np.ndarray, np.ndarray]:
    """``(theta, omega)`` of ``buffers`` buffers minimizing :func:`blt_loss` (float64, read-only)."""
    if buffers < 1:
        raise ValueError(f"privacy.mechanism.buffers must be >= 1, got {buffers}")
    decay = 1.0 - np.exp(np.linspace(np.log(1.0 / horizon), np.log(0.5), buffers))
    a = torch.tensor(np.log(decay / (1 - decay)), dtype=torch.float64, requires_grad=True)
    scale = torch.zeros(1, dtype=torch.float64, requires_grad=True)
    mix = torch.zeros(buffers, dtype=torch.float64, requires_grad=True)
    opt = torch.optim.LBFGS([a, scale, mix], lr=1.0, max_iter=iterations, tolerance_grad=1e-12,
                            tolerance_change=1e-15, history_size=20, line_search_fn="strong_wolfe")

    def params() -> tuple[torch.Tensor, torch.Tensor]:
        return torch.sigmoid(a), torch.sigmoid(scale) * torch.softmax(mix, 0)

    def loss() -> torch.Tensor:
        opt.zero_grad()
        value = blt_loss(*params(), horizon, separation)
        value.backward()
        return value

    opt.step(loss)
    theta, omega = params()
    return as_float64(theta.detach().numpy()), as_float64(omega.detach().numpy())


class BLTNoise(ToeplitzNoise):
    """BLT noise with ``buffers`` buffers optimized for ``horizon`` releases at min separation ``separation``."""

    kind = "blt"

    def __init__(self, seed: int, *, device: str | torch.device = "cpu", secure: bool = False, horizon: int,
                 separation: int, buffers: int) -> None:
        theta, omega = blt_parameters(horizon, buffers, separation)
        super().__init__(seed, device=device, secure=secure, horizon=horizon, separation=separation,
                         coefficients=blt_coefficients(theta, omega, horizon).numpy())
        self.theta, self.omega = [float(x) for x in theta], [float(x) for x in omega]

    def _coefficients(self) -> dict[str, Any]:
        """Also the buffers' decays ``theta`` and output weights ``omega``: ``coefficients[i] = sum_j omega_j
        theta_j^(i-1)`` for ``i >= 1``."""
        return {**super()._coefficients(), "theta": self.theta, "omega": self.omega}

    def _next(self, w: torch.Tensor, t: int) -> torch.Tensor:
        """The recurrence; buffers: ``S_1, ..., S_m``."""
        if not self._buffers:
            self._buffers = [torch.zeros_like(w) for _ in self.theta]
        y = w
        for omega, s in zip(self.omega, self._buffers):
            y.sub_(s, alpha=omega)
        for theta, s in zip(self.theta, self._buffers):
            s.mul_(theta).add_(y)
        return y
