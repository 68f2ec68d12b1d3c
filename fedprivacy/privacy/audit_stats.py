r"""Empirical lower bounds on epsilon from a distinguishing test (privacy auditing statistics).

A test that decides "canary present" vs "absent" from a mechanism's output has false-positive
rate FPR and false-negative rate FNR. Any (epsilon, delta)-DP mechanism forces

.. math:: \mathrm{FPR} + e^{\varepsilon}\,\mathrm{FNR} \ge 1 - \delta
          \quad\text{and}\quad
          \mathrm{FNR} + e^{\varepsilon}\,\mathrm{FPR} \ge 1 - \delta,

so with Clopper-Pearson UPPER confidence bounds on both rates (each at level ``alpha / 2``,
Bonferroni), with probability at least ``1 - alpha``

.. math:: \varepsilon \ge \max\Big(\log\frac{1 - \delta - \overline{\mathrm{FNR}}}{\overline{\mathrm{FPR}}},
                                   \log\frac{1 - \delta - \overline{\mathrm{FPR}}}{\overline{\mathrm{FNR}}}\Big).

References: Kairouz, Oh, Viswanath 2015 (hypothesis-testing view of DP); Jagielski, Ullman,
Oprea 2020, arXiv:2006.07709v1, §3 (Clopper-Pearson auditing); Nasr et al. 2021, arXiv:2101.04535.
"""

from __future__ import annotations

import math

import numpy as np
from scipy.stats import beta


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
