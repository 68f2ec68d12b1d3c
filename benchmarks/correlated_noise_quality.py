"""Correlated noise: are the streams the mechanisms they claim to be? No training.

Part (a), covariance. For each stream at a small horizon ``n`` the script draws ``2n`` releases (two
horizons: the strategy restarts) on ``M`` float64 coordinates with ``std = z C std_factor(t)`` at ``z C = 1``,
exactly as :class:`~fedprivacy.privacy.mechanism.GaussianMechanism` calls ``add_``, and compares the empirical
``2n x 2n`` covariance of the per-release noise with the covariance the strategy implies,
``s(C)^2 C^{-1} C^{-T}`` in each horizon and 0 across horizons. ``C`` is built densely here: for the
Toeplitz streams from ``stream.coefficients``; for the tree from an independent implementation written
below (each node's estimate is the generalized-least-squares / BLUE estimate of its sum from the noisy
nodes of its own subtree, computed by a dense solve, not by tree.py's recursion). Each entry's deviation is
divided by its standard error ``sqrt((S_ii S_jj + S_ij^2) / M)`` (Gaussian fourth moments); the largest
|z| over the ``2n(2n+1)/2`` distinct entries must stay under 5. The stream's ``std_factor(t)^2`` must equal the
implied diagonal (exactly), and ``stream.sensitivity`` is compared with a brute-force maximum of
``||C 1_pi||`` over every ``b``-min-separated participation pattern ``pi`` (for separation 1 the all-ones
pattern, exact when ``C >= 0`` entrywise, which is checked).

Part (b), root-mean-squared error of the ``n`` prefix sums at EQUAL epsilon relative to independent noise:
every correlated stream is one Gaussian event of multiplier ``z`` per horizon; independent noise with
``k = ceil(n / b)`` participations is ``k`` Gaussian events of ``z sqrt(k)``, i.e. the factorization
``C = I`` with ``s(I) = sqrt(k)``, whose prefix-sum MSE is ``k (n + 1) / 2`` per unit. Ratio

    RMSE ratio = sqrt( s(C)^2 * (1/n) ||A C^{-1}||_F^2 / (k (n + 1) / 2) )      (< 1: better than independent)

computed exactly (``prefix_error`` of ``C^{-1}``'s coefficients; for the tree, the prefix sum's variance is the
sum of the GLS node variances of its binary decomposition), and re-measured by simulating the streams for
small ``n``. References computed here (not quoted): the full square-root Toeplitz factorization
``C = A^{1/2}``, coefficients of ``(1 - x)^{-1/2}`` (Fichtenberger et al. 2023, arXiv:2202.11205), and, for
single participation, the optimal lower-triangular Toeplitz ``C`` for this objective (all ``n`` coefficients
optimized by L-BFGS from the square root; its sensitivity ``||c||`` is exact for one participation).

    python benchmarks/correlated_noise_quality.py [--coords 20000] [--seed 0]

Deterministic (seeded streams, seeded optimizations); exits 1 if a covariance check fails.
"""

from __future__ import annotations

import argparse
import datetime
import math
import platform
import sys
import time

import numpy as np
import torch

from machine import cpu_name  # this folder (the script's) is on sys.path
from fedprivacy.privacy.bandmf import BandMFNoise, bandmf_coefficients
from fedprivacy.privacy.blt import BLTNoise
from fedprivacy.privacy.matrix_factorization import inverse_coefficients, participations, prefix_error
from fedprivacy.privacy.noise import GaussianNoise
from fedprivacy.privacy.tree import TreeNoise

torch.set_num_threads(2)

# ---------------------------------------------------------------------------------------------
# An independent dense tree: GLS estimates of each node from its own subtree's noisy nodes
# ---------------------------------------------------------------------------------------------


def tree_nodes(n: int) -> list[tuple[int, int]]:
    """Complete dyadic nodes ``(level, j)`` (leaves ``j 2^l .. (j+1) 2^l - 1``) of a horizon of ``n`` leaves."""
    levels = int(math.floor(math.log2(n))) + 1
    return [(lev, j) for lev in range(levels) for j in range(n >> lev)]


def tree_strategy(n: int) -> tuple[np.ndarray, dict[tuple[int, int], int]]:
    """``C_tree``: one row per node, ``C[node, leaf] = 1`` if the node covers the leaf."""
    nodes = tree_nodes(n)
    index = {node: i for i, node in enumerate(nodes)}
    c = np.zeros((len(nodes), n))
    for (lev, j), i in index.items():
        c[i, j << lev:(j + 1) << lev] = 1.0
    return c, index


def gls_node_estimate(n: int, node: tuple[int, int], index: dict[tuple[int, int], int],
                      strategy: np.ndarray) -> np.ndarray:
    """Noise coefficients (over all nodes' unit noises) of the BLUE of ``node``'s sum from the noisy values of
    the nodes inside its subtree: ``a^T (M^T M)^{-1} M^T`` with ``M`` those nodes' rows restricted to its leaves."""
    lev, j = node
    leaves = np.arange(j << lev, (j + 1) << lev)
    inside = [i for (l2, j2), i in index.items() if l2 <= lev and (j2 << l2) >= leaves[0]
              and ((j2 + 1) << l2) <= leaves[-1] + 1]
    m = strategy[np.ix_(inside, leaves)]
    gain = np.linalg.solve(m.T @ m, m.T)  # leaves-from-observations
    weights = np.ones(len(leaves)) @ gain
    out = np.zeros(len(index))
    out[inside] = weights
    return out


def tree_release_matrix(n: int) -> np.ndarray:
    """``D`` (n x nodes): release ``t``'s noise is ``D[t-1] @ u`` (unit node noises): ``P_t - P_{t-1}``, where
    ``P_t`` sums the GLS estimates of the complete nodes of ``t``'s binary decomposition."""
    strategy, index = tree_strategy(n)
    estimate = {node: gls_node_estimate(n, node, index, strategy) for node in index}
    prefix = np.zeros((n + 1, len(index)))
    for t in range(1, n + 1):
        start = 0
        for lev in range(int(math.floor(math.log2(n))), -1, -1):
            if t - start >= 1 << lev:
                prefix[t] += estimate[(lev, start >> lev)]
                start += 1 << lev
    return np.diff(prefix, axis=0)


def gls_level_variance(level: int) -> float:
    """Variance (unit node noise) of the GLS estimate of a level-``level`` node from its subtree (dense solve)."""
    size = 1 << level
    strategy, index = tree_strategy(size)
    w = gls_node_estimate(size, (level, 0), index, strategy)
    return float(w @ w)


def tree_prefix_mse(n: int, level_var: list[float]) -> float:
    """``(1/n) sum_t Var(P_t)`` per unit node noise: disjoint subtrees' estimates are independent, so
    ``Var(P_t)`` is the sum of the node variances of ``t``'s binary decomposition (n a power of two)."""
    total = 0.0
    for t in range(1, n + 1):
        total += sum(level_var[lev] for lev in range(t.bit_length()) if t >> lev & 1)
    return total / n


# ---------------------------------------------------------------------------------------------
# Sensitivity by brute force
# ---------------------------------------------------------------------------------------------


def min_separated_patterns(n: int, b: int) -> np.ndarray:
    """Every non-empty set of columns of ``0..n-1`` pairwise at least ``b`` apart, as 0/1 rows."""
    rows: list[list[int]] = []

    def extend(pattern: list[int], nxt: int) -> None:
        for i in range(nxt, n):
            rows.append(pattern + [i])
            extend(pattern + [i], i + b)

    extend([], 0)
    out = np.zeros((len(rows), n))
    for r, cols in enumerate(rows):
        out[r, cols] = 1.0
    return out


def brute_sensitivity(strategy: np.ndarray, b: int) -> float:
    n = strategy.shape[1]
    if b == 1:  # every pattern; with C >= 0 entrywise, adding a column never lowers the norm: all columns
        assert (strategy >= -1e-12).all(), "C has negative entries: the all-ones pattern need not be worst"
        return float(np.linalg.norm(strategy.sum(1)))
    p = min_separated_patterns(n, b)
    return float(np.sqrt(((p @ strategy.T) ** 2).sum(1).max()))


def toeplitz_dense(c: np.ndarray, n: int) -> np.ndarray:
    full = np.zeros(n)
    full[:min(len(c), n)] = c[:n]
    return np.array([[full[i - j] if i >= j else 0.0 for j in range(n)] for i in range(n)])


# ---------------------------------------------------------------------------------------------
# (a) covariance
# ---------------------------------------------------------------------------------------------


def draw_releases(stream, releases: int, coords: int) -> np.ndarray:
    out = np.empty((releases, coords))
    for t in range(1, releases + 1):
        x = torch.zeros(coords, dtype=torch.float64)
        stream.add_(x, stream.std_factor(t))  # z C = 1: std = z C std_factor(t)
        out[t - 1] = x.numpy()
    return out


def covariance_check(name: str, stream, implied_one: np.ndarray, strategy: np.ndarray, coords: int) -> dict:
    n = stream.horizon
    implied = np.zeros((2 * n, 2 * n))
    implied[:n, :n] = implied[n:, n:] = implied_one
    x = draw_releases(stream, 2 * n, coords)
    emp = x @ x.T / coords
    diag = np.diag(implied)
    se = np.sqrt((np.outer(diag, diag) + implied ** 2) / coords)
    iu = np.triu_indices(2 * n)
    z = np.abs(emp - implied)[iu] / se[iu]
    std_factor2 = np.array([stream.std_factor(t) ** 2 for t in range(1, 2 * n + 1)])
    brute = brute_sensitivity(strategy, stream.separation)
    return {
        "name": name, "n": n, "b": stream.separation, "k": stream.participations,
        "max_dev_rel": float(np.abs(emp - implied).max() / diag.max()),
        "se_rel": float(se.max() / diag.max()),
        "max_z": float(z.max()),
        "cross_max_rel": float(np.abs(emp[:n, n:]).max() / diag.max()),
        "std_factor_err": float(np.abs(std_factor2 - diag).max() / diag.max()),
        "s_stream": float(stream.sensitivity), "s_brute": brute,
        "ok": bool(z.max() < 5.0 and np.abs(std_factor2 - diag).max() / diag.max() < 1e-9
                   and stream.sensitivity >= brute * (1 - 1e-9)),
    }


def part_a(coords: int, seed: int) -> list[dict]:
    n = 32
    rows = []
    tree = TreeNoise(seed, horizon=n, separation=4)
    d = tree_release_matrix(n)
    strategy, _ = tree_strategy(n)
    rows.append(covariance_check("tree", tree, tree.sensitivity ** 2 * d @ d.T, strategy, coords))
    for name, stream in [("bandmf bands 4", BandMFNoise(seed, horizon=n, separation=4, bands=4)),
                         ("blt buffers 3", BLTNoise(seed, horizon=n, separation=4, buffers=3)),
                         ("blt buffers 3", BLTNoise(seed, horizon=n, separation=1, buffers=3))]:
        c = toeplitz_dense(stream.coefficients, n)
        cinv = np.linalg.inv(c)
        rows.append(covariance_check(name, stream, stream.sensitivity ** 2 * cinv @ cinv.T, c, coords))
    return rows


# ---------------------------------------------------------------------------------------------
# (b) RMSE of prefix sums at equal epsilon
# ---------------------------------------------------------------------------------------------


def sqrt_coefficients(n: int) -> np.ndarray:
    out = np.ones(n)
    for i in range(1, n):
        out[i] = out[i - 1] * (2 * i - 1) / (2 * i)
    return out


def toeplitz_ratio(c: np.ndarray, s: float, n: int, k: int) -> float:
    r = inverse_coefficients(torch.tensor(np.asarray(c), dtype=torch.float64), n)
    return math.sqrt(float(prefix_error(r)) * s * s / ((n + 1) / 2 * k))


def sqrt_factor_ratio(n: int, b: int) -> float:
    """``C = A^{1/2}``: coefficients non-negative, non-increasing, so ``s = ||sum_j C[:, jb]||`` exactly."""
    c = sqrt_coefficients(n)
    k = participations(n, b)
    cols = np.zeros(n)
    for j in range(k):
        cols[j * b:] += c[:n - j * b]
    return toeplitz_ratio(c, float(np.linalg.norm(cols)), n, k)


def optimal_toeplitz_ratio(n: int, iterations: int = 300) -> float:
    """Single participation: ``min_c (1/n)||A C^{-1}||_F^2 ||c||^2`` over all ``n`` coefficients (``c_0 = 1``)."""
    c = torch.tensor(np.array(bandmf_coefficients(n, n, iterations)))  # BandMF's objective with every band free
    return math.sqrt(float(prefix_error(inverse_coefficients(c, n)) * (c @ c)) / ((n + 1) / 2))


def simulated_ratio(stream, coords: int, std=None) -> tuple[float, float]:
    """Prefix-sum RMSE of ``stream`` over one horizon (simulated on ``coords`` coordinates, ``z C = 1``) relative to
    independent noise's exact ``sqrt(k (n + 1) / 2)``, and its standard error (per-coordinate MSEs are iid).
    ``std``: a fixed std per release (the independent stream at ``sqrt(k)``) instead of ``std_factor(t)``."""
    n, k = stream.horizon, stream.participations
    x = np.empty((n, coords))
    for t in range(1, n + 1):
        y = torch.zeros(coords, dtype=torch.float64)
        stream.add_(y, stream.std_factor(t) if std is None else std)
        x[t - 1] = y.numpy()
    per = (np.cumsum(x, 0) ** 2).mean(0)
    ratio = math.sqrt(per.mean() / (k * (n + 1) / 2))
    return ratio, ratio * per.std() / per.mean() / math.sqrt(coords) / 2  # delta method


def part_b(seed: int, sim_coords: int) -> tuple[list[dict], list[dict], list[float]]:
    level_var = [gls_level_variance(lev) for lev in range(12)]  # n <= 2048 = 2^11
    rows, sims = [], []
    for n in (16, 64, 256, 1024, 2048):
        for b in (n, n // 16):
            k = participations(n, b)
            row: dict = {"n": n, "b": b, "k": k}
            tree = TreeNoise(seed, horizon=n, separation=b)
            row["tree"] = math.sqrt(tree.sensitivity ** 2 * tree_prefix_mse(n, level_var) / ((n + 1) / 2 * k))
            bands = min(b, 64)
            band = BandMFNoise(seed, horizon=n, separation=b, bands=bands)
            row["bands"] = bands
            row["bandmf"] = toeplitz_ratio(band.coefficients, band.sensitivity, n, k)
            blts = {m: BLTNoise(seed, horizon=n, separation=b, buffers=m) for m in (2, 3, 4, 5)}
            for m, blt in blts.items():
                row[f"blt{m}"] = toeplitz_ratio(blt.coefficients, blt.sensitivity, n, k)
            row["sqrt"] = sqrt_factor_ratio(n, b)
            row["opt"] = optimal_toeplitz_ratio(n) if k == 1 else float("nan")
            rows.append(row)
            if n <= 64:
                independent = GaussianNoise(seed + len(sims) + 1)
                independent.horizon, independent.participations = n, k
                for name, stream, exact, std in (
                        ("independent", independent, 1.0, math.sqrt(k)),
                        ("tree", TreeNoise(seed + len(sims) + 2, horizon=n, separation=b), row["tree"], None),
                        (f"bandmf {bands}", BandMFNoise(seed + len(sims) + 3, horizon=n, separation=b, bands=bands),
                         row["bandmf"], None),
                        ("blt 3", BLTNoise(seed + len(sims) + 4, horizon=n, separation=b, buffers=3), row["blt3"],
                         None)):
                    sim, se = simulated_ratio(stream, sim_coords, std)
                    sims.append({"n": n, "b": b, "name": name, "exact": exact, "sim": sim, "se": se})
    return rows, sims, level_var


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--coords", type=int, default=20000, help="M, independent coordinates per draw")
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    t0 = time.perf_counter()
    print(f"machine: {cpu_name()}, {torch.get_num_threads()} torch threads, torch {torch.__version__}, "
          f"numpy {np.__version__}, Python {platform.python_version()}; "
          f"{datetime.datetime.now(datetime.timezone.utc):%Y-%m-%d %H:%M} UTC; M = {args.coords}, seed {args.seed}")

    rows = part_a(args.coords, args.seed)
    print("\n(a) empirical vs implied covariance of the per-release noise, 2 horizons of n = 32 (z C = 1)\n")
    print("| stream | n | b | k | max abs dev / max diag | its SE scale | max abs z (entries) | "
          "max cross-horizon / diag | std_factor^2 vs diag | s(C) stream | s(C) brute force | ok |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(f"| {r['name']} | {r['n']} | {r['b']} | {r['k']} | {r['max_dev_rel']:.4f} | {r['se_rel']:.4f} | "
              f"{r['max_z']:.2f} | {r['cross_max_rel']:.4f} | {r['std_factor_err']:.1e} | {r['s_stream']:.4f} | "
              f"{r['s_brute']:.4f} | {'yes' if r['ok'] else '**NO**'} |")

    table, sims, level_var = part_b(args.seed, sim_coords=args.coords // 4)
    print("\nGLS node variances v_l (unit node noise), dense solve:",
          ", ".join(f"{v:.6f}" for v in level_var[:6]), "...; 2^l/(2^(l+1)-1):",
          ", ".join(f"{2 ** lev / (2 ** (lev + 1) - 1):.6f}" for lev in range(6)))
    print("\n(b) RMSE of the n prefix sums at equal epsilon / independent noise (exact; < 1 is better)\n")
    print("| n | b | k | tree | bandmf (bands) | blt 2 | blt 3 | blt 4 | blt 5 | sqrt Toeplitz A^1/2 | "
          "optimal Toeplitz (k=1) | tree / best blt |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for r in table:
        best = min(r[f"blt{m}"] for m in (2, 3, 4, 5))
        opt = "-" if math.isnan(r["opt"]) else f"{r['opt']:.4f}"
        print(f"| {r['n']} | {r['b']} | {r['k']} | {r['tree']:.4f} | {r['bandmf']:.4f} ({r['bands']}) | "
              f"{r['blt2']:.4f} | {r['blt3']:.4f} | {r['blt4']:.4f} | {r['blt5']:.4f} | {r['sqrt']:.4f} | {opt} | "
              f"{r['tree'] / best:.2f}x |")
    print("\nsimulated check: RMSE / sqrt(k (n+1)/2) from M/4 simulated coordinates (each stream its own seed)\n")
    print("| n | b | stream | exact | simulated +- SE | (sim - exact) / SE |")
    print("|---|---|---|---|---|---|")
    bad_sim = 0
    for s in sims:
        dz = (s["sim"] - s["exact"]) / s["se"]
        bad_sim += abs(dz) > 5
        print(f"| {s['n']} | {s['b']} | {s['name']} | {s['exact']:.4f} | {s['sim']:.4f} +- {s['se']:.4f} | "
              f"{dz:+.2f} |")
    print(f"\n{time.perf_counter() - t0:.1f} s")
    ok = all(r["ok"] for r in rows) and not bad_sim
    print("all checks passed" if ok else "SOME CHECK FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
