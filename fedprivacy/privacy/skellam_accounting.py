r"""Accounting of the distributed Skellam mechanism (:mod:`.skellam`): RDP of the Skellam mechanism with variance
:math:`\mu` (Agarwal, Kairouz, Liu 2021, arXiv:2110.04995, Thm. 3.5 / Cor. 3.6), integer orders :math:`\alpha > 1`:

.. math:: \varepsilon(\alpha) \le \frac{\alpha \Delta_2^2}{2\mu}
          + \min\Big(\frac{(2\alpha - 1)\Delta_2^2 + 6\Delta_1}{4\mu^2}, \frac{3\Delta_1}{2\mu}\Big)

amplified by Poisson sampling with Zhu and Wang's upper bound for any mechanism with an RDP curve ("Poisson
subsampled Renyi differential privacy", ICML 2019, Thm. 6), the smaller of the two per order. Fractional orders
get no bound (``inf``), so the conversion to :math:`(\varepsilon, \delta)` uses the integer ones. PLD and PRV do
not model Skellam noise: :func:`~fedprivacy.privacy.accounting.epsilon` reports ``None`` for them. Kept apart from
:mod:`.skellam` so that a client (which only encodes) never imports dp-accounting.

Neighbouring relation, as in the papers: the two sums differ by one user's rounded vector, with the same noise,
that of the round's surviving shares (:math:`\mu = n\mu_1`). Under add/remove-one where a removed user also takes
its own noise share away, the two sums' noise variances differ by one share; Thm. 3.5 does not bound that pair
(the Renyi divergence of Skellams of different variances is infinite at large orders), and it is not accounted
here.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import dp_accounting
import numpy as np
from scipy import special

from fedprivacy.privacy.events import register_event


def _skellam_rdp(alpha: int, variance: float, l2: float, l1: float) -> float:
    """Agarwal et al. 2021, Thm. 3.5 (module docstring), at an integer order."""
    if variance <= 0:
        return math.inf
    return alpha * l2 * l2 / (2 * variance) + min(((2 * alpha - 1) * l2 * l2 + 6 * l1) / (4 * variance ** 2),
                                                   3 * l1 / (2 * variance))


def poisson_subsampled_rdp(alpha: int, q: float, rdp: Any) -> float:
    r"""Zhu & Wang 2019's upper bound on the RDP of a mechanism with RDP curve ``rdp`` (integer orders) under
    Poisson sampling with rate ``q``, at integer order ``alpha >= 2``:

    .. math:: \frac{1}{\alpha - 1}\log\Big((1-q)^{\alpha-1}(\alpha q - q + 1) + \binom{\alpha}{2} q^2 (1-q)^{\alpha-2}
              e^{\varepsilon(2)} + 3\sum_{l=3}^{\alpha}\binom{\alpha}{l}(1-q)^{\alpha-l} q^l e^{(l-1)\varepsilon(l)}\Big)
    """
    if q >= 1:
        return rdp(alpha)
    if q <= 0:
        return 0.0
    terms = [0.0, math.log(special.comb(alpha, 2)) + 2 * math.log(q) + (alpha - 2) * math.log1p(-q) + rdp(2)]
    weights = [(1 - q) ** (alpha - 1) * (alpha * q - q + 1), 1.0]
    for j in range(3, alpha + 1):
        terms.append((j - 1) * rdp(j) + _log_comb(alpha, j) + (alpha - j) * math.log1p(-q) + j * math.log(q))
        weights.append(3.0)
    return float(special.logsumexp(terms, b=weights)) / (alpha - 1)


def _log_comb(n: int, k: int) -> float:
    return float(special.gammaln(n + 1) - special.gammaln(k + 1) - special.gammaln(n - k + 1))


def _finite(value: float) -> bool:
    try:
        return math.isfinite(value)
    except OverflowError:  # an int beyond float's range
        return False


@register_event
@dataclasses.dataclass(frozen=True)
class SkellamRound:
    """One release of the distributed Skellam mechanism over a Poisson-sampled cohort (add/remove one user).

    Attributes:
        q: the sampling rate.
        variance: mu, the per-coordinate variance of the noise the SURVIVING clients added (scaled units).
        l2_sensitivity, l1_sensitivity: Delta_2 and Delta_1 of one client's rounded vector (scaled units).
    """

    q: float
    variance: float
    l2_sensitivity: float
    l1_sensitivity: float

    def __post_init__(self) -> None:
        for name in ("q", "variance", "l2_sensitivity", "l1_sensitivity"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, float)) or not _finite(value) or value < 0:
                raise ValueError(f"SkellamRound.{name} must be a finite number >= 0, got {value!r}")
            object.__setattr__(self, name, float(value))
        if self.q > 1 or self.l2_sensitivity <= 0 or self.l1_sensitivity <= 0:
            raise ValueError(f"SkellamRound: need q <= 1 and positive sensitivities, got {self}")

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        return dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE

    def dp_event(self) -> dp_accounting.DpEvent:
        """dp-accounting has no Skellam event: RDP is :meth:`rdp`; PLD and PRV cannot account it."""
        return dp_accounting.UnsupportedDpEvent()

    def rdp(self, orders: tuple[float, ...]) -> np.ndarray:
        """RDP at each order (module docstring; ``inf`` at fractional orders and with no noise)."""
        def curve(alpha: int) -> float:
            return _skellam_rdp(alpha, self.variance, self.l2_sensitivity, self.l1_sensitivity)

        out = []
        for order in orders:
            if not float(order).is_integer() or self.variance <= 0:
                out.append(math.inf)
                continue
            alpha = int(order)
            out.append(min(curve(alpha), poisson_subsampled_rdp(alpha, self.q, curve)))
        return np.array(out, dtype=np.float64)
