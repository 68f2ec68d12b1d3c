r"""Server-side DiSK: a simplified Kalman filter on the privatized pseudo-gradients.

Round ``t`` (user-level DP: Zhang et al. 2024, arXiv:2410.03883, Alg. 3 with each sample mapped to a client
and the minibatch to the cohort; the paper has no federated setting):

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

Noise of the filtered gradient (what DP-FedAdamBC must subtract, not Phi): with ``g_t`` carrying
independent noise of per-coordinate variance :math:`\Phi_t`, the filter's output carries

.. math::
    V_0 = \Phi_0, \qquad V_t = (1-\kappa)^2 V_{t-1} + \kappa^2 \Phi_t
    \;\overset{\Phi_t \equiv \Phi}{=}\; \Phi\Big[(1-\kappa)^{2t}
        + \tfrac{\kappa}{2-\kappa}\big(1 - (1-\kappa)^{2t}\big)\Big]

(about ``0.54 Phi`` at ``kappa = 0.7``), tracked by :meth:`DiskFilter.filter_` as ``noise_variance``.

Orientation: the paper's ``(1-kappa) * old + kappa * new`` (Alg. 3, line 6); the Opacus research code's
reversed weights (``research/disk_optimizer``, since its commit e7b30c16) are NOT used. With
pseudo-gradients ``Delta = x_local - x`` the
combination and the filter are linear, so the sign convention carries through unchanged.

References: Zhang et al. 2024, arXiv:2410.03883, Alg. 3 and App. A.3.
"""

from __future__ import annotations

import torch

from fedprivacy.optim.broadcast import StepBroadcast
from fedprivacy.privacy.combination import Combination
from fedprivacy.updates import SparseUpdate


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
        self.noise_variance = 0.0
        """Per-coordinate noise variance of ``filtered`` (module docstring: ``V_t``)."""

    @property
    def c(self) -> float:
        return disk_coefficient(self.kappa, self.gamma)

    def lookahead(self, params: torch.Tensor) -> torch.Tensor | None:
        """``x_t + gamma * d_{t-1}``, or None when one pass from ``x_t`` is the whole update."""
        if self.kappa == 1.0 or self.displacement is None:
            return None
        return params + self.gamma * self.displacement

    def refusal(self, combination: Combination) -> str | None:
        """Noise correlated across rounds: the filter's ``V_t`` (module docstring) assumes it independent."""
        if combination.independent_noise:
            return None
        return (f"DiSK (disk_kappa={self.kappa}) models noise independent across rounds; noise_stream="
                f"{combination.noise_stream} correlates it (use one or the other)")

    def broadcast(self, params: torch.Tensor) -> StepBroadcast:
        """The lookahead ``x_t + gamma d_{t-1}`` (record ``lookahead``) and ``c`` (config ``disk-c``) for the clients'
        second pass; nothing when one pass from ``x_t`` is the whole update (:meth:`lookahead`)."""
        lookahead = self.lookahead(params)
        if lookahead is None:
            return StepBroadcast()
        return StepBroadcast({"lookahead": lookahead}, {"disk-c": self.c})

    def filter_(self, g: torch.Tensor, noise_variance: float = 0.0) -> torch.Tensor:
        """``g~ <- (1 - kappa) g~ + kappa g`` (``g~ = g`` on the first call); returns ``g~``.

        ``noise_variance``: the per-coordinate variance ``Phi_t`` of the noise in ``g``; the filtered
        one, ``V_t = (1 - kappa)^2 V_{t-1} + kappa^2 Phi_t``, is then in :attr:`noise_variance`.
        """
        if self.filtered is None:
            self.filtered = g.clone()
            self.noise_variance = noise_variance
        else:
            self.filtered.mul_(1.0 - self.kappa).add_(g, alpha=self.kappa)
            self.noise_variance = (1.0 - self.kappa) ** 2 * self.noise_variance + self.kappa**2 * noise_variance
        return self.filtered

    def record_(self, displacement: torch.Tensor) -> None:
        """Store ``d_t = x_{t+1} - x_t``, the base optimizer's actual step."""
        self.displacement = displacement

    def state_dict(self) -> dict:
        return {"filtered": self.filtered, "displacement": self.displacement, "noise_variance": self.noise_variance}

    def load_state_dict(self, state: dict) -> None:
        self.filtered = state["filtered"]
        self.displacement = state["displacement"]
        self.noise_variance = float(state.get("noise_variance", 0.0))  # absent before it was tracked
