r"""The distributed Skellam mechanism (Agarwal, Kairouz, Liu 2021, arXiv:2110.04995): integer client shares
that secure aggregation sums modulo :math:`2^b`, and its RDP accounting.

Client ``i``'s upload, all in integers once scaled (the paper's Alg. 1; the conditional rounding is Kairouz et
al. 2021, arXiv:2102.06387, Alg. 1 and Thm. 1):

.. math::
    x_i &= \operatorname{clip}(u_i, C) \in \mathbb R^d, \ \text{zero-padded to } D = 2^{\lceil \log_2 d \rceil} \\
    y_i &= s \cdot H_D \Sigma x_i / \sqrt D
        \qquad (\Sigma = \operatorname{diag}(\pm 1) \text{ from the round's public seed: a randomized Hadamard rotation}) \\
    \tilde y_i &= \text{randomized rounding of } y_i, \text{ redrawn until } \lVert \tilde y_i \rVert_2 \le \Delta_2 \\
    v_i &= \tilde y_i + \mathrm{Sk}(\mu / m) \bmod 2^b
        \qquad (\mathrm{Sk}(\lambda) = \mathrm{Poisson}(\lambda/2) - \mathrm{Poisson}(\lambda/2), \text{ variance } \lambda)

and the server, from the sum :math:`\sum_i v_i \bmod 2^b` (all it ever learns under secure aggregation), maps it
to :math:`[-2^{b-1}, 2^{b-1})`, divides by ``s`` and rotates back. Skellam noise is closed under summation: ``n``
shares sum to exactly :math:`\mathrm{Sk}(n\mu/m)`, so a round whose ``n`` survivors are fewer than ``m`` is the
Skellam mechanism with variance :math:`n\mu/m`, which is what it is accounted as (:meth:`SkellamParams.event`).

Parameters (:class:`SkellamParams`): ``z`` sets the total variance at ``m`` shares, :math:`\mu = (z C s)^2`, the
scaled analogue of the Gaussian :math:`N(0, z^2C^2)`; the scale ``s`` is the largest for which ``m`` clients'
sum stays inside the modulus with ``k`` standard deviations of headroom (TFF's ``DistributedDpSumFactory``
rule: :math:`2^{b} = 2k\sqrt{m^2 C^2 s^2/D + z^2C^2 s^2 + m/4}`); the rounded vectors' sensitivities are
Kairouz et al.'s bound with :math:`\beta = e^{-1/2}` (their conditional rounding, Thm. 1):

.. math::
    \Delta_2 = \min\Big(C s + \sqrt D,\ \sqrt{C^2s^2 + D/4 + \sqrt{2\log(1/\beta)}\,(Cs + \sqrt D / 2)}\Big),
    \qquad \Delta_1 = \min(\Delta_2^2, \sqrt D\, \Delta_2)

(an integer vector has :math:`|v_j| \le v_j^2`). The rounding ENFORCES :math:`\lVert\tilde y\rVert_2 \le \Delta_2`
(it redraws), so the bound is a sensitivity, not a high-probability statement.

Integrity (:meth:`SkellamParams.check_integrity`): the server refuses a decoded sum larger than ``n`` honest
clients' can be with probability :math:`\ge 1 - 10^{-9}`, which catches gross tampering (a wrap of many
coordinates) but not a malicious client's contribution up to :meth:`SkellamParams.undetected_norm`.

Accounting: :mod:`.skellam_accounting` (:class:`~fedprivacy.privacy.skellam_accounting.SkellamRound`, RDP of the
Skellam mechanism with Poisson amplification).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import secrets
from typing import TYPE_CHECKING

import numpy as np
import torch

if TYPE_CHECKING:
    from fedprivacy.privacy.skellam_accounting import SkellamRound


BETA = math.exp(-0.5)
"""Kairouz et al.'s rounding bound parameter (TFF's default): the rounding is redrawn with probability <= beta."""
MAX_ROUNDING_TRIES = 1000
"""Redraws of the conditional rounding before giving up (each succeeds with probability >= 1 - beta)."""
FALSE_ALARM = 1e-9
"""The probability that :meth:`SkellamParams.check_integrity` refuses a round of honest clients (at most)."""
MIN_BITS, MAX_BITS = 8, 32
"""The modulus bit widths accepted (shares are held as uint32 and travel packed, ``b`` bits each)."""


class IntegrityCheckFailed(RuntimeError):
    """The decoded sum is larger than the round's honest clients could have made it (some upload was tampered with)."""


def _fwht_(x: torch.Tensor) -> torch.Tensor:
    r"""The unnormalized Walsh-Hadamard transform :math:`H_D x` of a length :math:`D = 2^k` vector, in place."""
    h, n = 1, x.numel()
    buffer = torch.empty(n // 2, dtype=x.dtype, device=x.device)  # one scratch half-vector for every level
    while h < n:
        view = x.view(-1, 2, h)
        first = buffer.view(-1, h).copy_(view[:, 0, :])
        view[:, 0, :] += view[:, 1, :]
        view[:, 1, :].neg_().add_(first)
        h *= 2
    return x


def _signs(seed: int, size: int) -> torch.Tensor:
    """The rotation's diagonal :math:`\\Sigma` (float64 +-1) from the round's public seed."""
    bits = np.random.Generator(np.random.PCG64(seed)).integers(0, 2, size=size, dtype=np.int8)
    return torch.from_numpy(bits.astype(np.float64) * 2.0 - 1.0)


def rotate(x: torch.Tensor, seed: int, padded_dim: int) -> torch.Tensor:
    r""":math:`H_D \Sigma x / \sqrt D` of ``x`` zero-padded to ``padded_dim`` (float64; an orthogonal map)."""
    y = torch.zeros(padded_dim, dtype=torch.float64)
    y[: x.numel()] = x.to(torch.float64)
    return _fwht_(y.mul_(_signs(seed, padded_dim))).div_(math.sqrt(padded_dim))


def unrotate(y: torch.Tensor, seed: int, dim: int) -> torch.Tensor:
    r"""The inverse of :func:`rotate`: :math:`\Sigma H_D y / \sqrt D`, truncated to the first ``dim`` entries."""
    x = _fwht_(y.to(torch.float64).clone()).div_(math.sqrt(y.numel())).mul_(_signs(seed, y.numel()))
    return x[:dim]


def rounded_l2_bound(scaled_clip: float, padded_dim: int, beta: float = BETA) -> float:
    r""":math:`\Delta_2` of the conditionally rounded vector of norm ``<= scaled_clip`` (module docstring)."""
    loose = scaled_clip + math.sqrt(padded_dim)
    if beta == 0:
        return loose
    tight = scaled_clip ** 2 + padded_dim / 4 + math.sqrt(2 * math.log(1 / beta)) * (scaled_clip + math.sqrt(padded_dim) / 2)
    return min(loose, math.sqrt(tight))


def skellam_tail(variance: float, p: float) -> float:
    r"""A ``t`` with :math:`P(\mathrm{Sk}(\lambda) \ge t) \le p`, ``variance`` :math:`\lambda`, by Chernoff's bound
    with the Skellam log-MGF :math:`\lambda(\cosh\theta - 1)` at :math:`\theta = \operatorname{asinh}(t/\lambda)`:

    .. math:: P(\mathrm{Sk}(\lambda) \ge t) \le e^{-I(t)}, \qquad
              I(t) = t \operatorname{asinh}(t/\lambda) - \sqrt{\lambda^2 + t^2} + \lambda,

    solved for :math:`I(t) = \log(1/p)` (``I`` increases from 0) by bisection, from above; 0 without noise."""
    if variance <= 0:
        return 0.0
    target = math.log(1 / p)

    def rate(t: float) -> float:  # I(t) - log(1/p), with sqrt(l^2 + t^2) - l written without the cancellation
        return t * math.asinh(t / variance) - t * t / (math.sqrt(variance * variance + t * t) + variance) - target

    low, high = 0.0, math.sqrt(2 * variance * target) + target
    while rate(high) < 0:
        low, high = high, 2 * high
    for _ in range(60):  # bisection, keeping rate(high) >= 0: the returned t is never below the solution
        middle = (low + high) / 2
        low, high = (middle, high) if rate(middle) < 0 else (low, middle)
    return high


def skellam_square_norm_bound(variance: float, dim: int, p: float) -> float:
    r"""A ``u`` with :math:`P(\lVert e\rVert_2^2 > u) \le p` for ``dim`` iid :math:`e_j \sim \mathrm{Sk}(\lambda)`.

    :math:`e_j^2` has no moment generating function (Poisson tails are heavier than Gaussian ones), so truncate:
    with :math:`T` = :func:`skellam_tail` at :math:`p / (4D)`, :math:`P(\max_j |e_j| > T) \le 2D \cdot p/(4D) = p/2`
    (symmetry and a union bound). Otherwise :math:`\lVert e\rVert^2 = \sum_j X_j` with
    :math:`X_j = e_j^2 1\{|e_j| \le T\} \in [0, T^2]`, :math:`E X_j \le \lambda` and
    :math:`\operatorname{Var} X_j \le E e_j^4 = 3\lambda^2 + \lambda` (Skellam's cumulants
    :math:`\kappa_2 = \kappa_4 = \lambda`), and Bernstein's inequality gives
    :math:`P(\sum_j X_j \ge D\lambda + t) \le \exp(-t^2 / (2 D (3\lambda^2 + \lambda) + 2T^2 t/3)) = p/2` at

    .. math:: t = \frac{T^2 L}{3} + \sqrt{\Big(\frac{T^2 L}{3}\Big)^2 + 2 D (3\lambda^2 + \lambda) L},
              \qquad L = \log(2/p).
    """
    if variance <= 0:
        return 0.0
    cap = skellam_tail(variance, p / (4 * dim)) ** 2
    log_term = math.log(2 / p)
    linear = cap * log_term / 3
    return dim * variance + linear + math.sqrt(linear * linear + 2 * dim * (3 * variance ** 2 + variance) * log_term)


def signed(modular_sum: np.ndarray, bits: int) -> np.ndarray:
    """The representative in :math:`[-2^{b-1}, 2^{b-1})` of each value modulo ``2^bits`` (int64)."""
    values = np.asarray(modular_sum, dtype=np.int64) & ((1 << bits) - 1)
    values[values >= 1 << (bits - 1)] -= 1 << bits
    return values


@dataclasses.dataclass(frozen=True)
class SkellamParams:
    """What every client and the server derive alike for a model of ``dim`` values (module docstring).

    Attributes:
        dim: d, the number of values uploaded.
        clip_norm: C.
        noise_multiplier: z: the total noise variance at ``expected_cohort`` shares is ``(z C s)^2`` (scaled units).
        expected_cohort: m: the shares that make up the planned noise, and the cohort the headroom is sized for.
        bits: b: uploads and sums live modulo ``2^b``.
        k_stddevs: headroom of the modulus, in standard deviations of the sum (4: a coordinate of a sum as large as
            planned wraps with probability about 6e-5; TFF's default ``modclip_prob=1e-4`` is about 3.9).
        beta: the conditional rounding's parameter.
    """

    dim: int
    clip_norm: float
    noise_multiplier: float
    expected_cohort: int
    bits: int
    k_stddevs: float = 4.0
    beta: float = BETA

    def __post_init__(self) -> None:
        if not (isinstance(self.bits, int) and MIN_BITS <= self.bits <= MAX_BITS):
            raise ValueError(f"bits must be an integer in [{MIN_BITS}, {MAX_BITS}], got {self.bits!r}")
        if self.dim < 1 or self.expected_cohort < 1:
            raise ValueError(f"dim and expected_cohort must be >= 1, got {self.dim}, {self.expected_cohort}")
        for name, ok in (("clip_norm", 1e-30 < self.clip_norm < 1e30), ("noise_multiplier", 0 <= self.noise_multiplier < 1e6),
                         ("k_stddevs", 0 < self.k_stddevs < 1e6), ("beta", 0 <= self.beta < 1)):
            if not ok:
                raise ValueError(f"SkellamParams.{name} out of range: {getattr(self, name)!r}")
        half_range = 2.0 ** (self.bits - 1) / self.k_stddevs
        if half_range ** 2 <= self.expected_cohort / 4:
            raise ValueError(f"bits={self.bits} cannot hold the rounding of {self.expected_cohort} clients with "
                             f"{self.k_stddevs} standard deviations of headroom: raise bits")

    @property
    def modulus(self) -> int:
        return 1 << self.bits

    @functools.cached_property
    def padded_dim(self) -> int:
        """D: ``dim`` rounded up to a power of two (the Hadamard transform's length)."""
        return 1 << max(0, (self.dim - 1).bit_length())

    @functools.cached_property
    def scale(self) -> float:
        """s: the largest scale whose m-client sum fits the modulus with ``k_stddevs`` of headroom."""
        m, c, z = self.expected_cohort, self.clip_norm, self.noise_multiplier
        spread = m * m * c * c / self.padded_dim + (z * c) ** 2
        return math.sqrt(((2.0 ** (self.bits - 1) / self.k_stddevs) ** 2 - m / 4) / spread)

    @functools.cached_property
    def l2_sensitivity(self) -> float:
        """Delta_2 (scaled units): the largest norm a client's rounded vector can have."""
        return rounded_l2_bound(self.clip_norm * self.scale, self.padded_dim, self.beta)

    @property
    def l1_sensitivity(self) -> float:
        """Delta_1 (scaled units)."""
        d2 = self.l2_sensitivity
        return min(d2 * d2, math.sqrt(self.padded_dim) * d2)

    @property
    def total_variance(self) -> float:
        """mu: the planned noise variance per coordinate of the scaled sum, ``(z C s)^2``."""
        return (self.noise_multiplier * self.clip_norm * self.scale) ** 2

    @property
    def share_variance(self) -> float:
        """mu / m: the variance of one client's share."""
        return self.total_variance / self.expected_cohort

    def released_std(self, shares: int) -> float:
        """The noise std per coordinate of the decoded sum (unscaled) when ``shares`` clients added theirs."""
        return math.sqrt(shares * self.share_variance) / self.scale

    def event(self, shares: int, q: float) -> SkellamRound:
        """The accounting event of a round whose ``shares`` surviving clients added their noise (module docstring)."""
        from fedprivacy.privacy.skellam_accounting import SkellamRound  # the server's side only

        return SkellamRound(q=q, variance=shares * self.share_variance, l2_sensitivity=self.l2_sensitivity,
                            l1_sensitivity=self.l1_sensitivity)

    # -- the client's and the server's sides -----------------------------------------------------------------
    def encode(self, update: torch.Tensor, rotation_seed: int, rng: np.random.Generator) -> np.ndarray:
        """A client's share: clip, rotate, scale, round conditionally, add ``Sk(mu/m)``, wrap (uint32, length D)."""
        x = update.detach().to(torch.float64).flatten()
        if x.numel() != self.dim:
            raise ValueError(f"the update has {x.numel()} values, the mechanism was set up for {self.dim}")
        norm = float(torch.linalg.vector_norm(x))
        if not math.isfinite(norm):
            raise ValueError("the update holds NaN or Inf values")
        if norm > self.clip_norm:
            x = x * (self.clip_norm / norm)
        y = rotate(x, rotation_seed, self.padded_dim).mul_(self.scale).numpy()
        rounded = conditional_rounding(y, self.l2_sensitivity, rng)
        if self.share_variance > 0:
            lam = self.share_variance / 2
            rounded += rng.poisson(lam, size=rounded.size) - rng.poisson(lam, size=rounded.size)
        return np.bitwise_and(rounded.astype(np.uint64), np.uint64(self.modulus - 1)).astype(np.uint32)

    def decode(self, modular_sum: np.ndarray, rotation_seed: int) -> torch.Tensor:
        """The sum of the clients' shares, back in model units (float32, length ``dim``), from its value mod 2^b."""
        values = signed(modular_sum, self.bits).astype(np.float64) / self.scale
        return unrotate(torch.from_numpy(values), rotation_seed, self.dim).float()

    def integrity_bound(self, shares: int) -> float:
        r"""An upper bound, exceeded with probability at most :data:`FALSE_ALARM`, on the L2 norm of the signed
        decoded sum :math:`r` (integers, rotated and scaled) of ``shares`` = n honest clients:

        .. math:: \lVert r\rVert_2^2 \le B^2 = R^2 + 2R\,t_1 + u, \qquad R = n\Delta_2.

        Derivation: :math:`r_j = \operatorname{wrap}(S_j + e_j)` with :math:`S = \sum_i \tilde y_i` the rounded
        vectors' sum, :math:`\lVert S\rVert \le R` (the rounding enforces :math:`\Delta_2` per client), and
        :math:`e \sim \mathrm{Sk}(\lambda)^D`, :math:`\lambda = n\mu/m` (the survivors' shares), independent of
        ``S`` (each client draws its noise apart from its rounding). The signed mapping never increases a
        magnitude: :math:`|\operatorname{wrap}(x)| = |x|` for :math:`x \in [-2^{b-1}, 2^{b-1})`, else
        :math:`|\operatorname{wrap}(x)| \le 2^{b-1} \le |x|`; so honest wraps only shrink :math:`\lVert r\rVert`
        below :math:`\lVert S + e\rVert`, and :math:`\lVert S + e\rVert^2 = \lVert S\rVert^2 + 2\langle S,
        e\rangle + \lVert e\rVert^2` with

        - :math:`\langle S, e\rangle \le R\,t_1` with probability :math:`\ge 1 - p/2`, :math:`t_1` =
          :func:`skellam_tail` at :math:`p/2`: :math:`\log E e^{\theta\langle S, e\rangle} = \lambda\sum_j
          (\cosh\theta S_j - 1) \le \lambda(\cosh\theta R - 1)` (expand cosh; :math:`\sum_j S_j^{2k} \le
          \lVert S\rVert^{2k}`), the log-MGF of :math:`R\,\mathrm{Sk}(\lambda)`, so Chernoff's bound is the same;
        - :math:`\lVert e\rVert^2 \le u` = :func:`skellam_square_norm_bound` at :math:`p/2`,

        with :math:`p` = :data:`FALSE_ALARM`. Without noise (z = 0) it is the deterministic :math:`R`."""
        reach = shares * self.l2_sensitivity
        variance = shares * self.share_variance
        noise = skellam_tail(variance, FALSE_ALARM / 2)
        square = skellam_square_norm_bound(variance, self.padded_dim, FALSE_ALARM / 2)
        return math.sqrt(reach * reach + 2 * reach * noise + square)

    def check_integrity(self, modular_sum: np.ndarray, shares: int) -> None:
        """Raise :class:`IntegrityCheckFailed` if the unmasked sum of ``shares`` uploads is larger than
        :meth:`integrity_bound` (an honest round fails with probability at most :data:`FALSE_ALARM`)."""
        values = signed(modular_sum, self.bits).astype(np.float64)
        norm, bound = math.sqrt(float(np.dot(values, values))), self.integrity_bound(shares)
        if norm > bound:
            raise IntegrityCheckFailed(f"the decoded sum of {shares} uploads has norm {norm / self.scale:.6g}, above "
                                       f"the bound {bound / self.scale:.6g} that honest clients exceed with probability "
                                       f"<= {FALSE_ALARM:g} (model units): an upload was tampered with")

    def undetected_norm(self, shares: int) -> float:
        r"""How large a contribution (model units, L2) one malicious client among ``shares`` can add and pass
        :meth:`check_integrity`, typically: it uploads its vector instead of its noise share, the honest clients
        send nothing (the most room) and the others' noise has its mean squared norm
        :math:`(n-1) D \mu/m`, so :math:`\lVert a\rVert^2 \lesssim B^2 - (n-1) D\mu/m` (the cross terms have mean 0).
        The signal of honest clients of norm ``S`` (scaled) takes :math:`S^2` off; a client that adds its share
        takes another :math:`D\mu/m` off. At z = 1, C = 10, b = 20, m = n = 10: 934 C for d = 5,000,500
        (D = 2^23; 185 C sending its share) and 134 C for d = 100,050 (D = 2^17; 70 C). Pushing one coordinate by
        :math:`2^{b-1}` (a wrap) adds about :math:`4zC`, far inside; only a per-client range proof under secure
        aggregation (Bell et al. 2023, ACORN, arXiv:2210.10634, not implemented) would bound each client to C."""
        room = self.integrity_bound(shares) ** 2 - (shares - 1) * self.padded_dim * self.share_variance
        return math.sqrt(room) / self.scale

    def rounding_error_bound(self, clients: int) -> float:
        """An upper bound on the L2 distance between the decoded sum and the exact sum of ``clients`` clipped
        updates, at z = 0 without wrap-around: each rounded coordinate is within 1 of its value, so the scaled
        error is below ``clients sqrt(D)``, and the rotation back is orthogonal; plus the float32 rounding of the
        decoded sum (of norm at most ``clients C``: relative 2^-24 per value, 2^-23 with margin)."""
        return clients * math.sqrt(self.padded_dim) / self.scale + clients * self.clip_norm * 2.0 ** -23


def conditional_rounding(y: np.ndarray, bound: float, rng: np.random.Generator) -> np.ndarray:
    r"""Unbiased randomized rounding of ``y`` to integers (``floor(y) + Bernoulli(frac(y))``), redrawn until the
    result has L2 norm ``<= bound`` (Kairouz et al. 2021, Alg. 1); int64."""
    floor = np.floor(y)
    frac = y - floor
    base = floor.astype(np.int64)
    for _ in range(MAX_ROUNDING_TRIES):
        rounded = base + (rng.random(y.size) < frac)
        if float(np.dot(rounded.astype(np.float64), rounded.astype(np.float64))) <= bound * bound:
            return rounded
    raise RuntimeError(f"the conditional rounding exceeded its bound {bound:g} in {MAX_ROUNDING_TRIES} draws")


def client_rng(seed: int | None, *stream: int) -> np.random.Generator:
    """The generator of a client's rounding and noise: from the OS's cryptographic source (``seed`` None, a
    device's default) or, in a simulation, from ``(seed, *stream)``."""
    entropy = secrets.randbits(256) if seed is None else [seed, SKELLAM_STREAM, *stream]
    return np.random.Generator(np.random.PCG64(np.random.SeedSequence(entropy)))


SKELLAM_STREAM = 0x736B656C6C  # "skell": disjoint from the other seeded streams
