r"""Privacy estimates of a WHOLE training run from that one run, from canary clients' scores.

Each canary ``i`` has a random direction :math:`c_i`; its score is the cosine between the run's final model
change :math:`\Delta = x_T - x_0` and :math:`c_i` (:func:`cosines`).

**One-shot estimate** (Andrew, Kairouz, Oh, Oprea, McMahan, Suriyakumar, "One-shot Empirical Privacy
Estimation for Federated Learning", arXiv:2302.03098, ICLR 2024, Sec. 3 and Alg. 1). Inserted canaries send
their direction (clipped to the bound) whenever they are sampled; unobserved canaries are fresh directions
that never enter the run, whose cosines are :math:`\approx \mathcal N(0, 1/d)` (the null of Sec. 3). Alg. 1
fits :math:`\mathcal N(\mu, \sigma^2)` to the inserted canaries' cosines and reports the epsilon at ``delta``
of distinguishing that Gaussian from the null. Here the null's mean and variance are fitted on the
unobserved canaries' cosines (:math:`\mathcal N(\mu_0, \sigma_0^2)`, which is :math:`\mathcal N(0, 1/d)` up to
sampling error), and the epsilon is the one of the PAIR of Gaussians (:func:`gaussian_pair_epsilon`): the
smallest :math:`\varepsilon \ge 0` with

.. math:: \max\big(\delta_{P\|Q}(\varepsilon), \delta_{Q\|P}(\varepsilon)\big) \le \delta, \qquad
          \delta_{P\|Q}(\varepsilon) = P(L > \varepsilon) - e^{\varepsilon} Q(L > \varepsilon),
          \quad L = \log\frac{dP}{dQ}

(the privacy profile, Balle & Wang 2018, arXiv:1805.06530, Thm. 5). For equal variances this is the GDP
conversion with :math:`\mu = |\mu_1 - \mu_0| / \sigma` (:func:`~fedprivacy.privacy.audit_stats.gdp_epsilon`,
reused); for unequal ones :math:`L` is quadratic in :math:`x`, so :math:`\{L > \varepsilon\}` is an interval
or the complement of one and both probabilities are normal CDFs at its ends. Under the Gaussian mechanism both
laws have variance 1/d (Sec. 3), so the main estimate pools the two sets' variances (the GDP conversion);
the separate-variances one is reported beside it, but at small delta it is biased upward by the std ratio's
sampling error alone (200 canaries each, std ratio 1.05: epsilon 5.39 instead of 4.38 at delta 1e-5). Both are
point estimates (not bounds), each with a percentile-bootstrap interval over canaries (both sets resampled).

**Every round observed** (Andrew et al., arXiv:2302.03098, the threat model in which all model iterates are
observed): an adversary who sees every released model :math:`x_0, x_1, \dots, x_T` scores canary ``i`` by the
largest cosine between a round's model change and its direction, :math:`s_i = \max_t \cos(x_t - x_{t-1}, c_i)`
(:func:`max_over_rounds`, kept as a running maximum: O(k) memory for ``k`` directions, not O(T d)). Both estimates
are then taken of these scores, Alg. 1's Gaussian fit applied to the maxima with the null fitted on the unobserved
canaries' maxima (a maximum of T cosines is not Gaussian: an approximation, checked by simulating the Gaussian
mechanism in tests/privacy/test_canary_every_round.py). It is the adversary the accountant's epsilon is stated for,
so it is the estimate to hold against that claim.

**One-run lower bound** (Steinke, Nasr, Jagielski, "Privacy Auditing with One (1) Training Run",
arXiv:2305.08846, NeurIPS 2023). ``m`` canaries are each included independently with probability 1/2; the
auditor guesses "included" for the ``k+`` highest scores and "excluded" for the ``k-`` lowest and abstains on
the rest. If the run is (epsilon, delta)-DP for each canary, the number ``W`` of correct guesses out of
``r = k+ + k-`` satisfies (their Thm. 3.1, the main theorem, computed as in their Alg. 2)

.. math:: \Pr[W \ge v] \le f(v) + 2m\delta \max_{1 \le i \le v} \frac{f(v - i) - f(v)}{i}, \qquad
          f(v) = \Pr\big[\mathrm{Binomial}(r, \tfrac{e^\varepsilon}{1 + e^\varepsilon}) \ge v\big],

so every epsilon whose p-value (the right side at the observed ``v``) is below ``beta`` is rejected, and the
largest rejected one is a lower bound on the run's epsilon with confidence ``1 - beta``
(:func:`one_run_epsilon_lower_bound`).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch
from scipy.optimize import brentq
from scipy.special import erf, log_ndtr, ndtr
from scipy.stats import binom

from fedprivacy.privacy.audit_stats import gdp_delta, gdp_epsilon


def cosines(change: torch.Tensor, directions: torch.Tensor) -> np.ndarray:
    """The cosine between ``change`` (flat, ``d``) and each row of ``directions`` (``k x d``); 0 for a zero change."""
    norm = float(torch.linalg.vector_norm(change))
    if norm == 0.0:
        return np.zeros(directions.shape[0])
    dots = (directions.to(torch.float64) @ change.to(torch.float64)).numpy()
    return dots / (norm * torch.linalg.vector_norm(directions.to(torch.float64), dim=1).numpy())


def max_over_rounds(running: np.ndarray | None, round_cosines: np.ndarray) -> np.ndarray:
    r"""The every-round statistic after one more round (module docstring): :math:`\max(s_i, \cos(x_t - x_{t-1},
    c_i))` elementwise, ``running`` None before the first round; a new array (``running`` is not changed)."""
    cos = np.asarray(round_cosines, dtype=np.float64)
    if running is None:
        return cos.copy()
    if running.shape != cos.shape:
        raise ValueError(f"round_cosines has shape {cos.shape}, the running statistic {running.shape}")
    return np.maximum(running, cos)


EPSILON_BRACKET = 2.0**20
"""The largest epsilon :func:`gaussian_pair_epsilon` resolves: beyond it the two laws are apart by more than any
claim tests (``+inf``, read "epsilon > 2^20")."""


def _log_prob(region: tuple[str, float, float]) -> float:
    r"""``log P(X in region)`` for ``X ~ N(0, 1)``; ``region`` is ``("all"|"none"|"outside"|"inside", r1, r2)``:
    everything, nothing, :math:`(-\infty, r_1) \cup (r_2, \infty)` or :math:`(r_1, r_2)`. Without cancellation: an
    interval across 0 as two ``erf`` halves (its mass need not be large: it may be narrow), one off it from the
    tails on its side."""
    kind, lo, hi = region
    if kind == "all":
        return 0.0
    if kind == "none":
        return -math.inf
    if kind == "outside":
        return float(np.logaddexp(log_ndtr(lo), log_ndtr(-hi)))
    if lo <= 0 <= hi:
        p = (erf(hi / math.sqrt(2)) + erf(-lo / math.sqrt(2))) / 2
    else:
        p = ndtr(-lo) - ndtr(-hi) if lo > 0 else ndtr(hi) - ndtr(lo)  # the accurate tail
    return math.log(p) if p > 0 else -math.inf


def _positive_region(a: float, b: float, c: float) -> tuple[str, float, float]:
    """``{t : a t^2 + b t + c > 0}`` as a :func:`_log_prob` region."""
    if a == 0:  # equal stds (rho = 1): a half-line, or all or nothing
        if b == 0:
            return ("all" if c > 0 else "none", 0.0, 0.0)
        return ("outside", -math.inf, -c / b) if b > 0 else ("outside", -c / b, math.inf)
    disc = b * b - 4 * a * c
    if disc <= 0:
        return ("all" if a > 0 else "none", 0.0, 0.0)
    root = -0.5 * (b + math.copysign(math.sqrt(disc), b))  # the roots without cancellation: root / a and c / root
    r1, r2 = sorted((root / a, c / root))
    return ("outside" if a > 0 else "inside", r1, r2)


def _delta_one_way(eps: float, p: tuple[float, float], q: tuple[float, float]) -> float:
    r""":math:`\delta_{P\|Q}(\varepsilon) = P(L > \varepsilon) - e^\varepsilon Q(L > \varepsilon)` for two Gaussians
    ``(mean, std)`` of unequal stds (module docstring), in the standard coordinate of the NARROWER law
    :math:`(m_n, s_n)`, :math:`x = m_n + s_n t`: with :math:`\rho = s_n/s_w \le 1` and :math:`D = (m_n - m_w)/s_w`,

    .. math:: \log\frac{dN}{dW} = -\log\rho + D^2/2 + D\rho\, t - (1 - \rho^2)\, t^2/2,

    (:math:`L` or :math:`-L`), and the wider law's standard coordinate is :math:`D + \rho t`. Every coefficient is
    of the order of the answer. (Written in ``x``, the coefficients carry :math:`m^2/2s^2`, which cancel: a std of
    1e-14 beside means of 1e-2 gave a region where there is none, and :math:`e^\varepsilon Q` overflowed.) On
    :math:`\{L > \varepsilon\}`, :math:`e^\varepsilon q < p`, so the result is
    :math:`P(1 - e^{\varepsilon + \log Q - \log P}) \ge 0`; a rounding that says otherwise gives 0."""
    (m1, s1), (m0, s0) = (float(v) for v in p), (float(v) for v in q)
    p_narrow = s1 <= s0
    (mn, sn), (mw, sw) = ((m1, s1), (m0, s0)) if p_narrow else ((m0, s0), (m1, s1))
    rho, shift = sn / sw, (mn - mw) / sw
    a, b, c = -(1 - rho) * (1 + rho) / 2, shift * rho, -math.log(rho) + shift * shift / 2
    sign = 1.0 if p_narrow else -1.0  # L = log dP/dQ = sign * log dN/dW
    kind, r1, r2 = _positive_region(sign * a, sign * b, sign * c - eps)
    log_narrow, log_wide = _log_prob((kind, r1, r2)), _log_prob((kind, shift + rho * r1, shift + rho * r2))
    log_p, log_q = (log_narrow, log_wide) if p_narrow else (log_wide, log_narrow)
    if log_p == -math.inf or eps + log_q >= log_p:
        return 0.0
    return -math.exp(log_p) * math.expm1(eps + log_q - log_p)


def gaussian_pair_epsilon(mean: float, std: float, null_mean: float, null_std: float, delta: float) -> float:
    """The epsilon at ``delta`` of distinguishing N(mean, std^2) from N(null_mean, null_std^2), in either
    direction (module docstring); equal stds: :func:`~fedprivacy.privacy.audit_stats.gdp_epsilon`. ``+inf`` where
    it exceeds :data:`EPSILON_BRACKET` (or a std is 0 and the other not, or both are 0 and the means differ)."""
    if not 0 < delta < 1:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not all(math.isfinite(v) for v in (mean, std, null_mean, null_std)):
        raise ValueError(f"means and standard deviations must be finite, got mean={mean}, std={std}, "
                         f"null_mean={null_mean}, null_std={null_std}")
    if std < 0 or null_std < 0:
        raise ValueError(f"standard deviations must be non-negative, got {std} and {null_std}")
    if std == null_std:
        if std == 0:
            return 0.0 if mean == null_mean else math.inf
        mu = abs(mean - null_mean) / std
        return math.inf if gdp_delta(EPSILON_BRACKET, mu) > delta else gdp_epsilon(mu, delta)
    if std == 0 or null_std == 0:  # a point mass against a Gaussian: the point itself tells them apart
        return math.inf
    p, q = (mean, std), (null_mean, null_std)

    def excess(eps: float) -> float:  # nonincreasing in eps (a privacy profile)
        return max(_delta_one_way(eps, p, q), _delta_one_way(eps, q, p)) - delta

    if excess(0.0) <= 0:
        return 0.0
    if excess(EPSILON_BRACKET) > 0:
        return math.inf
    hi = 1.0
    while excess(hi) > 0:
        hi *= 2
    return float(brentq(excess, 0.0, hi, xtol=1e-10))


@dataclass(frozen=True)
class OneShotEstimate:
    """Andrew et al.'s estimate (module docstring) with percentile-bootstrap intervals: ``epsilon`` from one
    pooled variance (the model of their Sec. 3, where both laws have variance 1/d), ``epsilon_separate`` from
    each set's own variance (upward-biased at small delta: the std ratio's sampling error alone moves it)."""

    epsilon: float
    interval: tuple[float, float]
    epsilon_separate: float
    interval_separate: tuple[float, float]
    confidence: float
    inserted: int
    unobserved: int
    mean: float  # inserted canaries' cosines
    std: float
    null_mean: float  # unobserved canaries' cosines
    null_std: float


def _variance(x: np.ndarray) -> float:
    """The sample variance (``ddof=1``), exactly 0 for equal values: numpy's is their mean's rounding error squared
    otherwise (3 copies of 3.27e-3: std 5.3e-19, a separate-variances fit that reads a point mass as a Gaussian)."""
    return 0.0 if x.min() == x.max() else float(x.var(ddof=1))


def _fit_epsilons(observed: np.ndarray, null: np.ndarray, delta: float) -> tuple[float, float]:
    """(pooled-variance epsilon, separate-variances epsilon) of the two fitted Gaussians."""
    m1, m0 = float(observed.mean()), float(null.mean())
    v1, v0 = _variance(observed), _variance(null)
    pooled = math.sqrt(((observed.size - 1) * v1 + (null.size - 1) * v0) / (observed.size + null.size - 2))
    return (gaussian_pair_epsilon(m1, pooled, m0, pooled, delta),
            gaussian_pair_epsilon(m1, math.sqrt(v1), m0, math.sqrt(v0), delta))


def one_shot_epsilon(observed: np.ndarray, unobserved: np.ndarray, delta: float, *, confidence: float = 0.95,
                     resamples: int = 1000, rng: np.random.Generator) -> OneShotEstimate:
    """Andrew et al.'s epsilon estimates from the inserted (``observed``) and never-inserted (``unobserved``)
    canaries' cosines, and ``confidence`` percentile-bootstrap intervals over ``resamples`` resamplings of both."""
    obs, null = np.asarray(observed, dtype=np.float64), np.asarray(unobserved, dtype=np.float64)
    if obs.size < 2 or null.size < 2:
        raise ValueError(f"the one-shot estimate needs at least 2 inserted and 2 unobserved canaries, got "
                         f"{obs.size} and {null.size}")
    if not 0 < confidence < 1:
        raise ValueError(f"confidence must be in (0, 1), got {confidence}")
    boot = np.array([_fit_epsilons(rng.choice(obs, obs.size), rng.choice(null, null.size), delta)
                     for _ in range(resamples)])
    tail = (1 - confidence) / 2
    low, high = np.quantile(boot, [tail, 1 - tail], axis=0, method="inverted_cdf")  # inf: an ordinary order statistic
    pooled, separate = _fit_epsilons(obs, null, delta)
    return OneShotEstimate(pooled, (float(low[0]), float(high[0])), separate, (float(low[1]), float(high[1])),
                           confidence, obs.size, null.size, float(obs.mean()), math.sqrt(_variance(obs)),
                           float(null.mean()), math.sqrt(_variance(null)))


def one_run_p_value(canaries: int, guesses: int, correct: int, eps: float, delta: float) -> float:
    """Steinke et al.'s Thm. 3.1 bound on ``P[W >= correct]`` for an (eps, delta)-DP run (module docstring)."""
    q = 1 / (1 + math.exp(-eps))
    tail = float(binom.sf(correct - 1, guesses, q))  # f(v) = P[Binomial(r, q) >= v]
    i = np.arange(1, correct + 1)  # f(v - i) - f(v) = sum_{j=1..i} P[Binomial = v - j]
    worst = float((np.cumsum(binom.pmf(correct - i, guesses, q)) / i).max()) if correct else 0.0
    return min(1.0, tail + 2 * canaries * delta * worst)


def one_run_epsilon_lower_bound(canaries: int, guesses: int, correct: int, delta: float, beta: float) -> float:
    """The largest epsilon whose :func:`one_run_p_value` is below ``beta`` (0 if none): with probability at
    least ``1 - beta`` the run's epsilon exceeds it. The p-value increases with epsilon; bisection to 1e-9."""
    if not 0 <= correct <= guesses <= canaries:
        raise ValueError(f"need 0 <= correct <= guesses <= canaries, got {correct}, {guesses}, {canaries}")
    if not 0 < beta < 1:
        raise ValueError(f"beta must be in (0, 1), got {beta}")
    if guesses == 0 or one_run_p_value(canaries, guesses, correct, 0.0, delta) >= beta:
        return 0.0
    lo, hi = 0.0, 1.0
    while one_run_p_value(canaries, guesses, correct, hi, delta) < beta:
        lo, hi = hi, 2 * hi
    while hi - lo > 1e-9:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if one_run_p_value(canaries, guesses, correct, mid, delta) < beta else (lo, mid)
    return lo


@dataclass(frozen=True)
class OneRunBound:
    """Steinke et al.'s lower bound (module docstring) and the guesses it came from."""

    epsilon_lower_bound: float
    confidence: float
    canaries: int
    guesses: int
    correct: int


def one_run_bound(scores: np.ndarray, included: np.ndarray, k_plus: int, k_minus: int, delta: float,
                  beta: float = 0.05) -> OneRunBound:
    """Guess "included" for the ``k_plus`` highest ``scores`` and "excluded" for the ``k_minus`` lowest, count the
    correct guesses against ``included`` and bound epsilon (:func:`one_run_epsilon_lower_bound`)."""
    s, inc = np.asarray(scores, dtype=np.float64), np.asarray(included, dtype=bool)
    if s.shape != inc.shape or s.ndim != 1:
        raise ValueError(f"scores and included must be 1-d of one length, got {s.shape} and {inc.shape}")
    if k_plus < 0 or k_minus < 0 or k_plus + k_minus > s.size:
        raise ValueError(f"k_plus={k_plus} and k_minus={k_minus} must be non-negative and total at most {s.size}")
    order = np.argsort(s, kind="stable")
    correct = int(inc[order[s.size - k_plus:]].sum()) + int((~inc[order[:k_minus]]).sum())
    bound = one_run_epsilon_lower_bound(s.size, k_plus + k_minus, correct, delta, beta)
    return OneRunBound(bound, 1 - beta, s.size, k_plus + k_minus, correct)
