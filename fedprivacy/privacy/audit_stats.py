r"""Empirical lower bounds on epsilon from canary scores (privacy auditing statistics).

**Gaussian (f-DP) fit** (Nasr et al. 2023, arXiv:2302.07956, §4; Dong, Roth, Su 2019,
arXiv:1905.02383). A Gaussian mechanism's canary score is N(mu_in, s^2) with the canary and
N(mu_out, s^2) without it: the pair is mu-GDP with mu = |mu_in - mu_out| / s. From paired trials,
:func:`gaussian_fit` gives an exact (under that model) lower confidence bound on mu, and
:func:`gdp_epsilon` turns mu into the epsilon at delta by the exact conversion (DRS Cor. 2.13)

.. math:: \delta(\varepsilon) = \Phi\Big(-\frac{\varepsilon}{\mu} + \frac{\mu}{2}\Big)
          - e^{\varepsilon}\,\Phi\Big(-\frac{\varepsilon}{\mu} - \frac{\mu}{2}\Big).

One Gaussian-mechanism round with noise multiplier z is exactly (1/z)-GDP, so the claim and the
measurement are on the same scale; a few hundred trials bound epsilon within a factor ~1.5.

**Threshold test** (assumption-free). A test that decides "canary present" vs "absent" from a
mechanism's output has false-positive rate FPR and false-negative rate FNR. Any
(epsilon, delta)-DP mechanism forces

.. math:: \mathrm{FPR} + e^{\varepsilon}\,\mathrm{FNR} \ge 1 - \delta
          \quad\text{and}\quad
          \mathrm{FNR} + e^{\varepsilon}\,\mathrm{FPR} \ge 1 - \delta,

so with Clopper-Pearson UPPER confidence bounds on both rates (each at level ``alpha / 2``,
Bonferroni), with probability at least ``1 - alpha``

.. math:: \varepsilon \ge \max\Big(\log\frac{1 - \delta - \overline{\mathrm{FNR}}}{\overline{\mathrm{FPR}}},
                                   \log\frac{1 - \delta - \overline{\mathrm{FPR}}}{\overline{\mathrm{FNR}}}\Big).

It needs no model of the scores, but counting errors is weak: below ~1/n error rates it cannot
see, so at a few hundred trials it rarely certifies more than a fraction of a Gaussian round's epsilon.

References: Kairouz, Oh, Viswanath 2015 (hypothesis-testing view of DP); Jagielski, Ullman,
Oprea 2020, arXiv:2006.07709v1, §3 (Clopper-Pearson auditing); Nasr et al. 2021, arXiv:2101.04535.
"""

from __future__ import annotations

import math
import warnings
from dataclasses import dataclass

import numpy as np
from scipy.optimize import brentq
from scipy.special import log_ndtr, ndtr
from scipy.stats import beta, nct


def clopper_pearson_upper(successes: int, trials: int, alpha: float) -> float:
    """One-sided upper ``1 - alpha`` confidence bound on a binomial rate."""
    if trials <= 0:
        raise ValueError("trials must be positive")
    if successes >= trials:
        return 1.0
    return float(beta.ppf(1.0 - alpha, successes + 1, trials - successes))


def epsilon_lower_bound(false_positives: int, negatives: int, false_negatives: int, positives: int,
                        delta: float, alpha: float = 0.05) -> float:
    """The epsilon every (epsilon, delta)-DP mechanism must exceed to allow these error counts."""
    fpr = clopper_pearson_upper(false_positives, negatives, alpha / 2)
    fnr = clopper_pearson_upper(false_negatives, positives, alpha / 2)
    bounds = [0.0]
    for a, b in ((fnr, fpr), (fpr, fnr)):
        if b > 0 and 1.0 - delta - a > 0:
            bounds.append(math.log((1.0 - delta - a) / b))
    return max(bounds)


def best_threshold(scores_in: np.ndarray, scores_out: np.ndarray) -> float:
    """Threshold on ``score > t`` maximising TPR - FPR (fitted on a held-out split, never on the
    trials the bound is computed from)."""
    candidates = np.unique(np.concatenate([scores_in, scores_out]))
    if len(candidates) == 1:
        return float(candidates[0])
    mids = (candidates[:-1] + candidates[1:]) / 2
    tpr = (scores_in[:, None] > mids[None, :]).mean(0)
    fpr = (scores_out[:, None] > mids[None, :]).mean(0)
    return float(mids[np.argmax(tpr - fpr)])


def gdp_delta(eps: float, mu: float) -> float:
    r"""The smallest delta at which mu-GDP is (eps, delta)-DP (Dong, Roth, Su 2019, Cor. 2.13):
    :math:`\delta(\varepsilon) = \Phi(-\varepsilon/\mu + \mu/2) - e^{\varepsilon}\,\Phi(-\varepsilon/\mu - \mu/2)`,
    the second term in log space (it is ``inf * 0`` otherwise)."""
    if mu <= 0:
        return 0.0
    return float(ndtr(-eps / mu + mu / 2) - math.exp(eps + log_ndtr(-eps / mu - mu / 2)))


def gdp_epsilon(mu: float, delta: float) -> float:
    """The epsilon at which mu-GDP is (epsilon, delta)-DP: the root of :func:`gdp_delta` (decreasing in eps)."""
    if math.isinf(mu):
        return math.inf
    if gdp_delta(0.0, mu) <= delta:
        return 0.0
    hi = 1.0
    while gdp_delta(hi, mu) > delta:
        hi *= 2
    return float(brentq(lambda e: gdp_delta(e, mu) - delta, 0.0, hi, xtol=1e-12))


_T_MAX = 1e4


@dataclass(frozen=True)
class GaussianFit:
    """A Gaussian fit of paired canary scores: ``d_t = score(in) - score(out)`` of a trial pair.

    Under a Gaussian mechanism each pair's scores are N(a_t + Delta, s^2) and N(a_t, s^2) with the
    same ``a_t`` (the rest of the cohort is the same in both), so ``d_t ~ N(Delta, 2 s^2)`` and the
    pair is ``mu``-GDP with ``mu = |Delta| / s = sqrt(2) |theta|``, ``theta = Delta / sd(d)``.
    ``T = sqrt(n) mean(d) / sd(d)`` is noncentral t with ``n - 1`` degrees of freedom and
    noncentrality ``sqrt(n) theta``, so inverting its CDF at ``|T|`` gives an EXACT lower
    confidence bound on ``|theta|`` (Lehmann & Romano, Testing Statistical Hypotheses, §3.5);
    each tail gets ``alpha / 2``, so the bound on ``|theta|`` holds with probability ``1 - alpha``.
    """

    mean: float
    std: float
    mu: float
    mu_lower_bound: float


def gaussian_fit(differences: np.ndarray, alpha: float) -> GaussianFit:
    """Point estimate and ``1 - alpha`` lower confidence bound on ``mu`` from paired differences."""
    d = np.asarray(differences, dtype=np.float64)
    n = d.size
    if n < 2:
        raise ValueError("the Gaussian fit needs at least 2 pairs")
    mean, std = float(d.mean()), float(d.std(ddof=1))
    if std == 0.0:  # a noiseless mechanism: any shift is infinitely distinguishable
        mu = math.inf if mean != 0.0 else 0.0
        return GaussianFit(mean, std, mu, mu)
    # the bound grows with t; capping t (where scipy's noncentral t is still accurate) keeps it valid
    t = min(abs(mean) / std * math.sqrt(n), _T_MAX)

    def excess(theta: float) -> float:  # P(T >= t | theta) - alpha / 2, increasing in theta
        return float(nct.sf(t, n - 1, math.sqrt(n) * theta)) - alpha / 2

    with warnings.catch_warnings():  # scipy's series warns (and still converges) far in the tail
        warnings.simplefilter("ignore", RuntimeWarning)
        if excess(0.0) >= 0:
            theta_lo = 0.0
        else:
            hi = 1.0
            while excess(hi) < 0:
                hi *= 2
            theta_lo = float(brentq(excess, 0.0, hi, xtol=1e-10))
    return GaussianFit(mean, std, math.sqrt(2) * abs(mean) / std, math.sqrt(2) * theta_lo)
