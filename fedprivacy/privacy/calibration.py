r"""Privacy calibration: the noise multiplier for a budget, and the rounds a budget allows.

Calibration is kept separate from accounting (STYLE §2 item 6): both functions here only search,
and every ε they look at is :func:`fedprivacy.privacy.accounting.epsilon` of a homogeneous ledger
``[(GaussianRound(z, sampling, population, expected_cohort), T)]``, so a calibrated run meets its
budget under exactly the accountant (kind, orders, sampling convention such as ``fixed``'s z / 2)
that will account it.

For a fixed round, :math:`\varepsilon(z, T)` is non-increasing in the noise multiplier z and
non-decreasing in the number of rounds T (exactly so for ``rdp``: every per-order RDP is, and the
conversion is a minimum over orders of increasing functions of it; up to grid effects for
``pld``/``prv``). Both searches bracket, then bisect:

- :func:`calibrate_noise_multiplier` solves :math:`\varepsilon(z, T) = \varepsilon^\star` in
  :math:`\log z`, stopping once :math:`(1-\tau)\,\varepsilon^\star \le \varepsilon(z, T) \le
  \varepsilon^\star` (τ = ``tolerance``). The tolerance is on ε, where the budget lives.
- :func:`max_rounds` finds the integer boundary :math:`\varepsilon(T) \le \varepsilon^\star <
  \varepsilon(T+1)` by exponential search then bisection.

Why not dp_accounting's ``calibrate_dp_mechanism``: it guarantees ε <= target too, but it needs a
dp_accounting ``PrivacyAccountant``, whereas our ``rdp`` backend is Opacus' RDP (exact at fractional
orders, with ``fixed`` composed at z / 2) and our ``prv`` backend is Opacus' PRV; and its tolerance
is on the parameter (default 1e-6 in z), not on ε, so it neither promises how far below the target
ε lands nor stops as soon as that is close enough. Bisecting our own :func:`epsilon` gives the
ε-band guarantee directly, on the very accountant the run uses.

Cost: one :func:`epsilon` call per step (about 10 for calibration at τ = 0.01; 2 log2 T for
:func:`max_rounds`). ``rdp`` per-round RDP vectors are memoized per z, so :func:`max_rounds` costs
vector sums; PLD grids grow like :math:`1/z^2`. Measured (CPU, fresh process), calibration /
max_rounds with the answer near T: q = 100/342477, T = 1500: rdp 0.05 s / < 0.01 s, pld 3.7 s /
1.6 s, prv 1.5 s / 1.5 s; q = 0.05, T = 40: rdp 0.4 s / < 0.01 s, pld 0.6 s / 0.1 s, prv 1.5 s /
1.3 s. max_rounds is slower when the answer is far larger (pld/prv cost grows with T: 4 s / 18 s
for T ≈ 4e5 at q = 100/342477).
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Callable, Sequence
from typing import Any

from fedprivacy.privacy.accounting import AccountantKind, GaussianRound, Sampling, epsilon
from fedprivacy.privacy.bounds import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER

_MAX_BISECTIONS = 100


def _require(ok: bool, name: str, expected: str, value: Any) -> None:
    if not ok:
        raise ValueError(f"{name} must be {expected}, got {value!r}")


def _is_positive_real(x: Any) -> bool:
    return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x) and x > 0


def _is_int_at_least(x: Any, minimum: int) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and x >= minimum


def _epsilon_of(noise_multiplier: float, rounds: int, delta: float, sampling: Sampling, population: int,
                expected_cohort: float, accountant: AccountantKind,
                rdp_orders: Sequence[float] | None) -> float:
    """ε of ``rounds`` identical rounds; raises if ``accountant`` cannot account ``sampling``."""
    rnd = GaussianRound(noise_multiplier, sampling, population, expected_cohort)
    eps = epsilon([(rnd, rounds)], delta, accountant, rdp_orders=rdp_orders)
    if eps is None:
        raise ValueError(f"accountant={accountant!r} cannot account sampling={sampling!r}; use accountant='rdp'")
    return eps


def calibrate_noise_multiplier(target_epsilon: float, delta: float, *, sampling: Sampling, population: int,
                               expected_cohort: float, rounds: int, accountant: AccountantKind = "rdp",
                               rdp_orders: Sequence[float] | None = None, tolerance: float = 0.01) -> float:
    r"""Smallest noise multiplier z whose ε after ``rounds`` rounds is within ``tolerance`` below the target.

    Returns z with

    .. math:: (1-\tau)\,\varepsilon^\star \;\le\; \varepsilon(z, T) \;\le\; \varepsilon^\star,

    where :math:`\varepsilon(z, T)` is :func:`epsilon` at ``delta`` of T rounds of
    ``GaussianRound(z, sampling, population, expected_cohort)``. Search: starting from z = 1, halve
    or double z to a bracket :math:`\varepsilon(z_{lo}) > \varepsilon^\star \ge \varepsilon(z_{hi})`,
    then bisect at :math:`\sqrt{z_{lo} z_{hi}}`, always keeping the upper end, so the result never
    exceeds the budget. Since ε is continuous and non-increasing in z, the band is reached.

    Symbols: target_epsilon = ε*, tolerance = τ, rounds = T, noise_multiplier z = noise std / C.

    References: dp_accounting ``mechanism_calibration.calibrate_dp_mechanism`` (bracket by doubling,
    then search; see the module docstring for why we do not call it).

    Args:
        target_epsilon: ε* > 0, the budget at ``delta``.
        delta: target δ in (0, 1).
        sampling: ``"poisson"``, ``"fixed"`` or ``"none"`` (see :class:`GaussianRound`).
        population: N, the population the cohort is drawn from.
        expected_cohort: q·N (poisson), m (fixed) or N (none); must be > 0.
        rounds: T >= 1, the number of rounds the run will release.
        accountant: ``"rdp"``, ``"prv"`` or ``"pld"``, as the run will account (``fixed``: rdp only).
        rdp_orders: RDP orders for ``"rdp"`` (default Opacus' ``DEFAULT_ALPHAS``), as :func:`epsilon`.
        tolerance: τ in (0, 1): how far below ε* the calibrated ε may fall.

    Returns:
        The noise multiplier z (a float > 0).

    Raises:
        ValueError: an argument is out of range (the message names it); ``accountant`` cannot account
            ``sampling``; ``expected_cohort`` is 0 (ε is 0 whatever z); ``target_epsilon`` is below the
            accountant's floor (see :data:`MAX_NOISE_MULTIPLIER`) or is met even at
            :data:`MIN_NOISE_MULTIPLIER`; or no z falls in the band (``tolerance`` too tight for a
            grid-based accountant).
    """
    _require(_is_int_at_least(rounds, 1), "rounds", "an integer >= 1", rounds)
    if GaussianRound(1.0, sampling, population, expected_cohort).q == 0:
        raise ValueError("expected_cohort must be > 0: with no one sampled, epsilon is 0 for every noise multiplier")

    def eps(z: float) -> float:
        return _epsilon_of(z, rounds, delta, sampling, population, expected_cohort, accountant, rdp_orders)

    return solve_noise_multiplier(eps, target_epsilon, accountant=accountant, delta=delta, tolerance=tolerance)


def solve_noise_multiplier(eps: Callable[[float], float], target_epsilon: float, *, accountant: str, delta: float,
                           tolerance: float = 0.01) -> float:
    """The search of :func:`calibrate_noise_multiplier` on any ε(z) non-increasing in z (e.g. a correlated
    mechanism's planned ledger): z with ``(1 - tolerance) target <= eps(z) <= target``.

    Raises:
        ValueError: as :func:`calibrate_noise_multiplier` (unreachable, met at the smallest z, no z in the band).
    """
    _require(_is_positive_real(target_epsilon), "target_epsilon", "a finite number > 0", target_epsilon)
    _require(_is_positive_real(tolerance) and tolerance < 1, "tolerance", "in (0, 1)", tolerance)

    lo = hi = 1.0
    eps_hi = eps(hi)
    if eps_hi <= target_epsilon:  # walk down until the budget breaks: eps(lo) > target
        while True:
            lo /= 2
            if lo < MIN_NOISE_MULTIPLIER:
                raise ValueError(f"target_epsilon={target_epsilon} is met even at noise_multiplier="
                                 f"{MIN_NOISE_MULTIPLIER} (epsilon {eps_hi:.4g}): too large to calibrate")
            eps_lo = eps(lo)
            if eps_lo > target_epsilon:
                break
            hi, eps_hi = lo, eps_lo
    else:  # walk up until the budget holds: eps(hi) <= target
        while eps_hi > target_epsilon:
            lo, hi = hi, 2 * hi
            if hi > MAX_NOISE_MULTIPLIER:
                raise ValueError(f"target_epsilon={target_epsilon} is unreachable: accountant={accountant!r} gives "
                                 f"epsilon {eps_hi:.4g} > target even at noise_multiplier={lo} (its floor at "
                                 f"delta={delta}; see MAX_NOISE_MULTIPLIER)")
            eps_hi = eps(hi)

    for _ in range(_MAX_BISECTIONS):
        if eps_hi >= (1 - tolerance) * target_epsilon:
            return hi
        mid = math.sqrt(lo * hi)
        eps_mid = eps(mid)
        if eps_mid <= target_epsilon:
            hi, eps_hi = mid, eps_mid
        else:
            lo = mid
    raise ValueError(f"no noise multiplier in [{lo}, {hi}] gives epsilon within tolerance={tolerance} below "
                     f"target_epsilon={target_epsilon} (accountant={accountant!r} jumps there); raise tolerance")


def max_rounds(target_epsilon: float, delta: float, *, noise_multiplier: float, sampling: Sampling, population: int,
               expected_cohort: float, accountant: AccountantKind = "rdp",
               rdp_orders: Sequence[float] | None = None, limit: int = 10 ** 7) -> int:
    r"""Largest number of rounds T <= ``limit`` whose ε stays within the budget.

    Returns T with

    .. math:: \varepsilon(T) \le \varepsilon^\star < \varepsilon(T + 1)\quad(\text{or } T = \text{limit}),

    where :math:`\varepsilon(T)` is :func:`epsilon` at ``delta`` of T rounds of
    ``GaussianRound(noise_multiplier, sampling, population, expected_cohort)`` and ε(0) = 0. Search:
    T = 1, 2, 4, … until ε(T) > ε* (or ``limit``), then bisection on the last doubling. Bisection
    keeps ε(lo) <= ε* < ε(hi) and stops at hi = lo + 1, so the boundary condition above holds for
    the returned T even where a grid-based accountant is not exactly monotone. ε reaching ε* exactly
    is within budget (as in :func:`~fedprivacy.privacy.accounting.would_exceed`); T + 1 is the first
    round count past the budget.

    Args:
        target_epsilon: ε* > 0, the budget at ``delta``.
        delta: target δ in (0, 1).
        noise_multiplier: z = noise std / C, >= 0 (z = 0 with sampled users gives 0 rounds).
        sampling: ``"poisson"``, ``"fixed"`` or ``"none"`` (see :class:`GaussianRound`).
        population: N, the population the cohort is drawn from.
        expected_cohort: q·N (poisson), m (fixed) or N (none).
        accountant: ``"rdp"``, ``"prv"`` or ``"pld"`` (``fixed``: rdp only).
        rdp_orders: RDP orders for ``"rdp"``, as :func:`epsilon`.
        limit: the largest T considered, >= 1 (returned when ε(limit) <= ε*, e.g. for q = 0).

    Returns:
        T, an integer in [0, limit]; 0 if a single round already exceeds the budget.

    Raises:
        ValueError: an argument is out of range (the message names it), or ``accountant`` cannot
            account ``sampling``.
    """
    _require(_is_positive_real(target_epsilon), "target_epsilon", "a finite number > 0", target_epsilon)
    _require(_is_int_at_least(limit, 1), "limit", "an integer >= 1", limit)

    def eps(t: int) -> float:
        return _epsilon_of(noise_multiplier, t, delta, sampling, population, expected_cohort, accountant, rdp_orders)

    lo, hi = 0, 1  # invariant: eps(lo) <= target; search hi with eps(hi) > target
    while eps(hi) <= target_epsilon:
        if hi == limit:
            return int(limit)
        lo, hi = hi, min(2 * hi, limit)
    while hi - lo > 1:
        mid = (lo + hi) // 2
        if eps(mid) <= target_epsilon:
            lo = mid
        else:
            hi = mid
    return int(lo)
