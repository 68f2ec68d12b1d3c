r"""Correlated noise by matrix factorization: what tree aggregation, BandMF and BLT share.

The mechanism (Denisov et al. 2022, arXiv:2202.08312, §2; Choquette-Choo et al. 2023, arXiv:2211.06530, §2).
Round ``t`` releases the clipped sum ``x_t`` plus noise correlated across rounds,

.. math::
    \hat x = x + \sigma\, s(C)\, C^{-1} w, \qquad w \sim \mathcal N(0, I_{n \times d}),

for a lower-triangular strategy (encoder) matrix ``C``, so that the released prefix sums
:math:`A \hat x = A x + \sigma\, s(C)\, A C^{-1} w` (``A`` the lower-triangular ones, the prefix-sum
workload) carry the noise of the decoder :math:`B = A C^{-1}`. Released values are post-processing of
:math:`C x + \sigma s(C) w`, a Gaussian mechanism whose L2 sensitivity in units of the clip norm is
:math:`s(C) = \max_{\pi} \lVert \sum_{i\in\pi} C_{:,i}\rVert` over the participation patterns ``pi`` the
schedule allows. ``sigma`` is the run's noise multiplier ``z`` (times ``C_clip``): the whole horizon is ONE
Gaussian event of multiplier ``z``, or, for BandMF with at most ``b`` bands under cyclic Poisson participation,
``ceil(n / b)`` Poisson-subsampled Gaussian events (Choquette-Choo et al. 2023, arXiv:2306.08153, Thm. 4).

Release ``t``'s own noise has per-coordinate std :math:`\sigma\, s(C) \lVert (C^{-1})_{t,:}\rVert`: its
:meth:`CorrelatedNoise.std_factor` in units of ``sigma``, what DP-FedAdamBC's Phi and ``server_noise_std``
read. Noise is drawn as :math:`w_t` from the run's dedicated generator (a :class:`~.noise.GaussianNoise`)
and turned into :math:`(C^{-1}w)_t` by a recurrence on a few model-sized buffers (the subclasses).

Toeplitz strategies (BandMF, BLT): ``C`` lower-triangular Toeplitz with coefficients :math:`c_0, c_1, \dots`;
then :math:`C^{-1}` is lower-triangular Toeplitz with the power-series inverse ``r`` of ``c``, and ``B = A C^{-1}``
has coefficients :math:`\sum_{i \le k} r_i`. Sensitivity under ``b``-min-separated participation with at most
``k`` participations (McMahan et al. 2024, arXiv:2408.08868, Thm. 2; Choquette-Choo et al. 2023,
arXiv:2306.08153, §4): when the coefficients are non-negative and non-increasing,
:math:`s(C) = \lVert \sum_{j<k} C_{:, jb} \rVert` exactly; when ``C`` has at most ``b`` bands its columns
``b`` apart are orthogonal, their norms do not grow with the column, and the same formula is exact
(:math:`= \sqrt{k}\,\lVert c\rVert` when ``(k-1) b`` plus the bands fit in ``n``). :func:`toeplitz_sensitivity`
refuses any other ``c``.
"""

from __future__ import annotations

from typing import Any

import abc

import numpy as np
import torch

from fedprivacy.privacy.accounting import CoveredRelease, MatrixMechanismRun
from fedprivacy.privacy.events import AccountedEvent
from fedprivacy.privacy.noise import GaussianNoise


def participations(horizon: int, separation: int) -> int:
    """``k = ceil(n / b)``: the most releases of ``horizon`` one user can join, ``separation`` rounds apart."""
    return -(-horizon // separation)


def _polymul(a: torch.Tensor, b: torch.Tensor, n: int) -> torch.Tensor:
    """The first ``n`` coefficients of the product of the power series ``a`` and ``b`` (FFT, differentiable)."""
    size = 1 << (len(a) + len(b) - 2).bit_length()
    return torch.fft.irfft(torch.fft.rfft(a, size) * torch.fft.rfft(b, size), size)[:n]


def inverse_coefficients(c: torch.Tensor, n: int) -> torch.Tensor:
    r"""The first ``n`` coefficients ``r`` of :math:`1 / \sum_i c_i x^i`, i.e. ``C^{-1}``'s Toeplitz coefficients
    (Newton's iteration :math:`r \leftarrow r (2 - c r) \bmod x^{2m}`, FFT products; differentiable)."""
    full = torch.zeros(n, dtype=c.dtype)
    full[:min(len(c), n)] = c[:n]
    r = (1.0 / full[:1])
    m = 1
    while m < n:
        m = min(2 * m, n)
        cr = _polymul(full[:m], r, m)
        two_minus = -cr
        two_minus = two_minus + torch.nn.functional.pad(torch.full((1,), 2.0, dtype=c.dtype), (0, m - 1))
        r = _polymul(r, two_minus, m)
    return r[:n]


def prefix_error(r: torch.Tensor) -> torch.Tensor:
    r"""Mean squared error of the ``n`` prefix sums per unit noise: :math:`\frac1n\lVert A C^{-1}\rVert_F^2
    = \frac1n\sum_{k<n} (n-k) \bigl(\sum_{i\le k} r_i\bigr)^2` for ``C^{-1}``'s coefficients ``r``."""
    n = len(r)
    b = torch.cumsum(r, 0)
    weights = torch.arange(n, 0, -1, dtype=r.dtype)
    return (weights * b * b).sum() / n


def strided_column_sum(c: torch.Tensor, n: int, separation: int, k: int) -> torch.Tensor:
    """:math:`\\sum_{j<k} C_{:, jb}` of the ``n x n`` lower-triangular Toeplitz ``C`` with coefficients ``c``
    (entry ``t`` is :math:`\\sum_{j<k,\\, jb \\le t} c_{t - jb}`: a cumulative sum over rows of ``b``)."""
    rows = -(-n // separation)
    full = torch.zeros(rows * separation, dtype=c.dtype)
    full[:min(len(c), n)] = c[:n]
    cs = torch.cumsum(full.reshape(rows, separation), 0).reshape(-1)[:n]
    if k * separation >= n:
        return cs
    return cs - torch.nn.functional.pad(cs[:n - k * separation], (k * separation, 0))


def toeplitz_sensitivity(c: torch.Tensor, n: int, separation: int, k: int) -> torch.Tensor:
    """``s(C) = ||sum_{j<k} C[:, jb]||`` of the Toeplitz strategy with coefficients ``c`` (module docstring; exact
    when ``c`` has at most ``separation`` bands, or is non-negative and non-increasing; differentiable).

    Raises:
        ValueError: ``c`` is neither (no exact formula: the sensitivity would be a search over patterns).
    """
    bands = int(torch.nonzero(c).max()) + 1 if bool((c != 0).any()) else 0
    head = c[:n].detach()
    if bands > separation and (bool((head < 0).any()) or bool((head[1:] > head[:-1] + 1e-12).any())):
        raise ValueError(f"a Toeplitz strategy with {bands} bands > min separation {separation} needs non-negative, "
                         "non-increasing coefficients for its sensitivity (McMahan et al. 2024, Thm. 2)")
    return torch.linalg.vector_norm(strided_column_sum(c, n, separation, k))


class CorrelatedNoise(abc.ABC):
    r"""A :class:`~.noise.NoiseStream` releasing :math:`\sigma s(C) (C^{-1} w)_t` (module docstring).

    Subclasses give the recurrence (:meth:`_next`, on model-sized buffers), :meth:`_row_norm` (the norm of
    ``C^{-1}``'s row ``t``) and ``sensitivity`` (``s(C)``). Releases are numbered from 1 within the stream;
    the strategy restarts (fresh buffers, a new accounted run) every ``horizon`` releases.

    Args:
        seed, device, secure: as :class:`~.noise.GaussianNoise` (the ``w_t`` come from one).
        horizon: ``n``, the releases one strategy covers (then it restarts).
        separation: ``b``, the fewest rounds between two participations of one user (the schedule's groups).
        amplified: account the releases as the schedule's own events (sound only for BandMF with at most
            ``b`` bands under cyclic Poisson participation); else one :class:`MatrixMechanismRun` per horizon.
    """

    kind = "correlated"
    independent = False
    """Noise correlated across releases: DiSK's filter, which assumes independent noise, refuses it."""

    def __init__(self, seed: int, *, device: str | torch.device = "cpu", secure: bool = False, horizon: int,
                 separation: int, amplified: bool = False) -> None:
        if horizon < 1 or separation < 1:
            raise ValueError(f"horizon and separation must be >= 1, got {horizon} and {separation}")
        self.horizon, self.separation, self.amplified = horizon, separation, amplified
        self.participations = participations(horizon, separation)
        self._w = GaussianNoise(seed, device=device, secure=secure)
        self.index = 0  # releases drawn so far
        self._buffers: list[torch.Tensor] = []

    # -- what a release is -------------------------------------------------------------------
    sensitivity: float

    @abc.abstractmethod
    def _row_norm(self, t: int) -> float:
        """``||(C^{-1})_{t,:}||`` for ``t`` in ``1..horizon``."""

    @abc.abstractmethod
    def _next(self, w: torch.Tensor, t: int) -> torch.Tensor:
        """``(C^{-1} w)_t`` from this release's ``w_t`` (``t`` in ``1..horizon``), updating the buffers."""

    def _position(self, release: int) -> int:
        return (release - 1) % self.horizon + 1

    def std_factor(self, release: int) -> float:
        """``s(C) ||(C^{-1})_{t,:}||``: release ``release``'s noise std in units of ``z C``."""
        return self.sensitivity * self._row_norm(self._position(release))

    def event(self, sampled: AccountedEvent, release: int) -> AccountedEvent:
        """Amplified: the schedule's own event. Otherwise the horizon's one Gaussian event at its first release
        and :class:`CoveredRelease` after it (``sampled`` carries ``z`` either way). A horizon may start at any
        release: within any ``n`` consecutive releases a user joins at most ``k`` times, ``b`` apart."""
        if self.amplified:
            return sampled
        z = getattr(sampled, "noise_multiplier", None)
        if not isinstance(z, float):
            raise TypeError(f"the {self.kind} mechanism reads z from its schedule's event, got {sampled!r}")
        if self._position(release) != 1:
            return CoveredRelease(noise_multiplier=z, by=self.kind)
        return MatrixMechanismRun(noise_multiplier=z, mechanism=self.kind, horizon=self.horizon,
                                  separation=self.separation, participations=self.participations)

    def describe_strategy(self) -> dict[str, Any]:
        """What a reader needs to rebuild the strategy ``C`` and check the noise (``noise_mechanism.json``): the
        kind, the horizon ``n``, the schedule's ``b`` and ``k``, the sensitivity ``s(C)`` the noise is scaled by, and
        the subclass's coefficients (:meth:`_coefficients`)."""
        return {"kind": self.kind, "horizon": self.horizon, "separation": self.separation,
                "participations": self.participations, "amplified": self.amplified,
                "sensitivity": float(self.sensitivity), **self._coefficients()}

    @abc.abstractmethod
    def _coefficients(self) -> dict[str, Any]:
        """The strategy's own numbers (:meth:`describe_strategy`), JSON-able."""

    def check_schedule(self, kind: str, separation: int | None) -> None:
        """Refuse a participation schedule this strategy's sensitivity does not hold for (one line)."""
        if separation is None:
            raise ValueError(f"privacy.mechanism {self.kind} needs privacy.sampling: min_separated or cyclic_poisson "
                             f"(or a schedule of one's own with a separation), got {kind!r} (it bounds no user's "
                             "participations: the strategy's sensitivity is unbounded)")
        if separation != self.separation:
            raise ValueError(f"privacy.mechanism {self.kind} was built for min separation {self.separation}, but "
                             f"privacy.groups={separation} separates the schedule's participations")
        if self.amplified and kind != "cyclic_poisson":
            raise ValueError(f"amplified {self.kind} accounting needs privacy.sampling: cyclic_poisson, got {kind!r}")

    # -- the draw --------------------------------------------------------------------------
    def prefetch_(self, like: torch.Tensor) -> None:
        """Start the next ``w_t`` early (on :class:`~.noise.GaussianNoise`'s thread)."""
        self._w.prefetch_(like)

    def draw_id(self) -> str:
        """The fingerprint of the generator state ``w_t`` is drawn from."""
        return self._w.draw_id()

    def _fresh(self, like: torch.Tensor) -> torch.Tensor:
        w = torch.zeros_like(like)
        self._w.add_(w, 1.0)
        return w

    def add_(self, target: torch.Tensor, std: float) -> None:
        """Add ``std / ||(C^{-1})_{t,:}|| (C^{-1} w)_t``: ``z C s(C) (C^{-1}w)_t`` (``std`` is ``z C
        std_factor(t)``); at ``std = 0`` the stream still advances (no noise is drawn)."""
        t = self._position(self.index + 1)
        if t == 1:
            self._buffers = []
        self.index += 1
        if std == 0.0:  # z = 0 (no privacy): every release's std is 0, so skipping the recurrence is exact
            return
        y = self._next(self._fresh(target), t)
        target.add_(y, alpha=std / self._row_norm(t))

    # -- state -----------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The generator, the position and the buffers (noise: persisted for seeded runs only, by the mechanism)."""
        return {"generator": self._w.state_dict(), "index": self.index,
                "buffers": [b.detach().cpu().clone() for b in self._buffers]}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self._w.load_state_dict(state["generator"])
        self.index = int(state["index"])
        device = self._w.device
        self._buffers = [torch.as_tensor(b).to(device) for b in state["buffers"]]


def as_float64(values: Any) -> np.ndarray:
    """``values`` as a read-only float64 array."""
    out = np.array(values, dtype=np.float64)
    out.setflags(write=False)
    return out


class ToeplitzNoise(CorrelatedNoise):
    """A :class:`CorrelatedNoise` whose strategy is lower-triangular Toeplitz with coefficients ``c``
    (``coefficients``, float64): row norms of ``C^{-1}`` from its coefficients ``r``; the sensitivity from
    :func:`toeplitz_sensitivity` (one participation's column norm when ``amplified``)."""

    def __init__(self, seed: int, *, device: str | torch.device = "cpu", secure: bool = False, horizon: int,
                 separation: int, coefficients: np.ndarray, amplified: bool = False) -> None:
        super().__init__(seed, device=device, secure=secure, horizon=horizon, separation=separation,
                         amplified=amplified)
        c = torch.tensor(np.array(coefficients), dtype=torch.float64)
        self.coefficients = as_float64(c.numpy())
        k = 1 if amplified else self.participations
        self.sensitivity = float(toeplitz_sensitivity(c, horizon, separation, k))
        r = inverse_coefficients(c, horizon).numpy()
        self._row_norms = as_float64(np.sqrt(np.cumsum(r * r)))

    def _row_norm(self, t: int) -> float:
        return float(self._row_norms[t - 1])

    def _coefficients(self) -> dict[str, Any]:
        """``C`` is the ``n x n`` lower-triangular Toeplitz matrix with ``C[i, j] = coefficients[i - j]`` (0 beyond)."""
        return {"strategy": "lower-triangular Toeplitz: C[i, j] = coefficients[i - j] for i >= j",
                "coefficients": [float(x) for x in self.coefficients]}
