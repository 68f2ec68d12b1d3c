r"""Server-side DiSK: a simplified Kalman filter on the privatized pseudo-gradients.

Round ``t`` (user-level DP, ``notes/disk.md`` §2.2; paper Alg. 3 mapped sample -> client):

.. math::
    u_i &= c\,\Delta_i(x_t + \gamma d_{t-1}) + (1-c)\,\Delta_i(x_t), \qquad c = \frac{1-\kappa}{\kappa\gamma} \\
    g_t &= \tfrac1m\Big(\textstyle\sum_i \operatorname{clip}(u_i, C) + \mathcal N(0, z^2C^2 I)\Big) \\
    \tilde g_t &= (1-\kappa)\,\tilde g_{t-1} + \kappa\, g_t, \qquad \tilde g_{-1} = g_0 \\
    x_{t+1} &= \mathrm{ServerOpt}(x_t, \tilde g_t), \qquad d_t = x_{t+1} - x_t

Symbols: ``kappa`` = κ (filter gain), ``gamma`` = γ (lookahead step), ``d`` = the server's actual
previous model change (public: a function of released values only, invariant 9).

Each client trains from both points with common randomness (same data order) and sends ONE
combined vector, which the server clips once; the mechanism is DP-FedAvg's, so the privacy cost
is identical (the filter is post-processing). Single-pass cases: the first round (``d = 0``),
``kappa = 1`` (``c = 0``: plain base optimizer) and ``c = 1`` (lookahead only).

Orientation: the paper's ``(1-kappa) * old + kappa * new``; the Opacus research code's reversed
weights are NOT used (``notes/disk.md`` §7). With pseudo-gradients ``Delta = x_local - x`` the
combination and the filter are linear, so the sign convention carries through unchanged.

References: Zhang et al. 2024, arXiv:2410.03883, Alg. 3 and App. A.3.
"""

from __future__ import annotations

import torch

from fedprivacy.privacy.aggregation import SparseUpdate


def disk_coefficient(kappa: float, gamma: float) -> float:
    """``c = (1 - kappa) / (kappa * gamma)``: the weight of the lookahead delta."""
    return (1.0 - kappa) / (kappa * gamma)


def disk_combination(lookahead: SparseUpdate, current: SparseUpdate | None, c: float) -> SparseUpdate:
    """``u = c * lookahead + (1 - c) * current`` as one update (``current`` None means c = 1).

    Both deltas come from the same client data, so they share their support; the combined vector
    is what the client transmits and what the server clips (ONE clip per client).
    """
    if current is None:
        return lookahead
    if lookahead.dim != current.dim:
        raise ValueError("DiSK deltas of different dimension")
    if lookahead.indices is not None and current.indices is not None and torch.equal(lookahead.indices, current.indices):
        return SparseUpdate(lookahead.indices, c * lookahead.values + (1.0 - c) * current.values, lookahead.dim)
    return SparseUpdate.dense(c * lookahead.to_dense() + (1.0 - c) * current.to_dense())


class DiskFilter:
    """The server's filter state ``(g~, d)`` and the lookahead it broadcasts."""

    def __init__(self, kappa: float, gamma: float) -> None:
        if not 0.0 < kappa <= 1.0:
            raise ValueError(f"server.disk.kappa must be in (0, 1], got {kappa}")
        if gamma == 0.0:
            raise ValueError("server.disk.gamma must be non-zero")
        self.kappa = kappa
        self.gamma = gamma
        self.filtered: torch.Tensor | None = None
        self.displacement: torch.Tensor | None = None

    @property
    def c(self) -> float:
        return disk_coefficient(self.kappa, self.gamma)

    def lookahead(self, params: torch.Tensor) -> torch.Tensor | None:
        """``x_t + gamma * d_{t-1}``, or None when one pass from ``x_t`` is the whole update."""
        if self.kappa == 1.0 or self.displacement is None:
            return None
        return params + self.gamma * self.displacement

    def filter_(self, g: torch.Tensor) -> torch.Tensor:
        """``g~ <- (1 - kappa) g~ + kappa g`` (``g~ = g`` on the first call); returns ``g~``."""
        if self.filtered is None:
            self.filtered = g.clone()
        else:
            self.filtered.mul_(1.0 - self.kappa).add_(g, alpha=self.kappa)
        return self.filtered

    def record_(self, displacement: torch.Tensor) -> None:
        """Store ``d_t = x_{t+1} - x_t``, the base optimizer's actual step."""
        self.displacement = displacement

    def state_dict(self) -> dict:
        return {"filtered": self.filtered, "displacement": self.displacement}

    def load_state_dict(self, state: dict) -> None:
        self.filtered = state["filtered"]
        self.displacement = state["displacement"]
