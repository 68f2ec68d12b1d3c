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
MIN_BITS, MAX_BITS = 8, 32
"""The modulus bit widths accepted (shares are held as uint32 and travel packed, ``b`` bits each)."""


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
        signed = np.asarray(modular_sum, dtype=np.int64) & (self.modulus - 1)
        signed[signed >= self.modulus // 2] -= self.modulus
        return unrotate(torch.from_numpy(signed.astype(np.float64) / self.scale), rotation_seed, self.dim).float()

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
