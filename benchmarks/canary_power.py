r"""Canary power: how often a canary run catches a Gaussian mechanism that adds less noise than it claims.

At the estimator level (no training, no users): a run of ``T`` rounds releases, per round, the sum of the
sampled canaries' clipped updates plus Gaussian noise; it CLAIMS noise multiplier ``z`` and ADDS ``r z``
(``r = 1``: correct; ``r < 1``: the violation). In units of ``C/m`` the final model change is

.. math:: x_T - x_0 = \sum_{i \text{ included}} n_i c_i + \sqrt T\, r z\, g, \qquad
          n_i \sim \mathrm{Binomial}(T, q), \ g \sim \mathcal N(0, I_d),

with ``k`` canaries of unit random directions :math:`c_i \in \mathbb R^d`, each included with probability 1/2
and then sampled Poisson(``q``) each round, and ``k`` unused directions (the null, with the excluded canaries),
as ``privacy.canaries`` runs it (:mod:`fedprivacy.fl.canaries`). Each canary's score is the cosine of its
direction with the change; the run's two estimators (:mod:`fedprivacy.privacy.canary_estimates`):

- Andrew et al. (arXiv:2302.03098, Alg. 1): ``one_shot_epsilon``; caught when its 95% bootstrap interval's
  lower end is above the claim;
- Steinke et al. (arXiv:2305.08846, Thm. 3.1): ``one_run_bound`` with ``k/4`` guesses each side, 95%; caught
  when the bound is above the claim.

The claim is the PLD epsilon of ``T`` Poisson(``q``)-subsampled Gaussian rounds of multiplier ``z`` at
``delta``; the table also gives the true epsilon (multiplier ``r z``). Per cell (``k`` x ``T`` x ``r``),
``--runs`` independent runs; reported: the fraction caught by each estimator and the median one-shot estimate.

    python benchmarks/canary_power.py [--runs 20] [--d 10000] [--q 0.1] [--z 1.0] [--delta 1e-5]
        [--resamples 200] [--k 50 200 1000] [--rounds 10 50] [--r 1 0.5 0.25]
"""

from __future__ import annotations

import argparse
import statistics
import time

import numpy as np

from machine import machine_line  # this folder (the script's) is on sys.path
from fedprivacy.privacy.accounting import epsilon_for
from fedprivacy.privacy.canary_estimates import one_run_bound, one_shot_epsilon


def one_run(rng: np.random.Generator, k: int, d: int, rounds: int, q: float, z: float, r: float, delta: float,
            resamples: int) -> tuple[float, float, float]:
    """One simulated run (module docstring): (one-shot estimate, its interval's lower end, one-run bound)."""
    included = rng.random(k) < 0.5
    directions = rng.standard_normal((2 * k, d))
    directions /= np.linalg.norm(directions, axis=1, keepdims=True)
    participations = rng.binomial(rounds, q, size=k) * included
    change = participations @ directions[:k] + np.sqrt(rounds) * r * z * rng.standard_normal(d)
    scores = directions @ change / np.linalg.norm(change)
    canary, unused = scores[:k], scores[k:]
    andrew = one_shot_epsilon(canary[included], np.concatenate([canary[~included], unused]), delta,
                              resamples=resamples, rng=rng)
    steinke = one_run_bound(canary, included, k // 4, k // 4, delta, 0.05)
    return andrew.epsilon, andrew.interval[0], steinke.epsilon_lower_bound


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--runs", type=int, default=20)
    ap.add_argument("--d", type=int, default=10_000)
    ap.add_argument("--q", type=float, default=0.1)
    ap.add_argument("--z", type=float, default=1.0)
    ap.add_argument("--delta", type=float, default=1e-5)
    ap.add_argument("--resamples", type=int, default=200)
    ap.add_argument("--k", type=int, nargs="+", default=[50, 200, 1000])
    ap.add_argument("--rounds", type=int, nargs="+", default=[10, 50])
    ap.add_argument("--r", type=float, nargs="+", default=[1.0, 0.5, 0.25])
    ap.add_argument("--seed", type=int, default=0)
    a = ap.parse_args()
    print(machine_line())
    print(f"d={a.d}, q={a.q}, claimed z={a.z}, delta={a.delta}, {a.runs} runs per cell, {a.resamples} bootstrap "
          "resamples\n")
    print("| k | T | r | claimed epsilon | true epsilon | Andrew caught | Steinke caught | median Andrew estimate |")
    print("|---|---|---|---|---|---|---|---|")
    rng = np.random.default_rng(a.seed)
    for rounds in a.rounds:
        claim = epsilon_for("poisson", a.q, a.z, rounds, a.delta, "pld")
        for r in a.r:
            truth = epsilon_for("poisson", a.q, a.z * r, rounds, a.delta, "pld")
            for k in a.k:
                t0 = time.perf_counter()
                runs = [one_run(rng, k, a.d, rounds, a.q, a.z, r, a.delta, a.resamples) for _ in range(a.runs)]
                andrew = sum(low > claim for _, low, _ in runs) / a.runs
                steinke = sum(bound > claim for _, _, bound in runs) / a.runs
                median = statistics.median(e for e, _, _ in runs)
                print(f"| {k} | {rounds} | {r:g} | {claim:.2f} | {truth:.2f} | {andrew:.2f} | {steinke:.2f} | "
                      f"{median:.2f} |  ({time.perf_counter() - t0:.0f} s)", flush=True)


if __name__ == "__main__":
    main()
