r"""Privacy accounting of rounds of the (subsampled) Gaussian mechanism, user-level.

One round releases :math:`S + \mathcal N(0, z^2 C^2 I_d)`, where :math:`S` sums the flat-L2-clipped
updates (:math:`\lVert u_i\rVert \le C`) of a sampled cohort and :math:`z` is the noise multiplier.
The accounting event matches the sampler (ARCHITECTURE invariant 5):

- ``poisson``: each of N users w.p. q; add/remove-one (Δ = C); ``PoissonSampledDpEvent(q, GaussianDpEvent(z))``.
- ``fixed``: m of N without replacement; replace-one (Δ = 2C); ``SampledWithoutReplacementDpEvent(N, m, ·)``.
- ``none``: all N users every round, no amplification; add/remove-one (Δ = C); ``GaussianDpEvent(z)``.

:class:`PrivacyLedger` (run-length list of rounds) is the single source of truth; every call to
:func:`epsilon` rebuilds the accountant from it, composing entries in order, so heterogeneous runs
(noise or cohort changing mid-run) and checkpoint resumes need no accountant state.

Backends (``kind``), and why:

- ``rdp``. poisson/none: Opacus ``RDPAccountant`` semantics: per-round RDP from
  ``opacus.accountants.analysis.rdp.compute_rdp`` (Mironov, Talwar, Zhang, arXiv:1908.10530, §3.3;
  exact at fractional orders, whereas dp_accounting 0.6.0 sums |binomial coefficients| there, a
  looser bound), summed over entries, converted by its ``get_privacy_spent``:
  :math:`\varepsilon = \min_\alpha R(\alpha) + \log\frac{\alpha-1}{\alpha}
  - \frac{\log\delta + \log\alpha}{\alpha-1}` (Balle et al., arXiv:1905.09982, Thm. 21).
  Orders: Opacus ``RDPAccountant.DEFAULT_ALPHAS`` unless ``rdp_orders`` is given.
  fixed: dp_accounting ``RdpAccountant(neighboring_relation=REPLACE_ONE)`` on
  ``SampledWithoutReplacementDpEvent`` (Wang, Balle, Kasiviswanathan, arXiv:1808.00087, Thm. 27),
  same orders, dp_accounting's conversion (arXiv:2004.00010v4, Prop. 12: the same formula).
  **Departure:** that bound wants z relative to the replace-one L2 sensitivity, 2C for a clipped
  sum, but dp_accounting 0.6.0 passes ``GaussianDpEvent.noise_multiplier`` (defined as s / C)
  straight through, underestimating RDP 4x at q = 1 (google/differential-privacy issue #378,
  open; its PLD does use 2C). We compose ``z / 2``.
- ``prv``: Opacus ``PRVAccountant`` (Gopi, Lee, Wutschitz, arXiv:2106.02848), history built from the
  ledger; an upper bound, estimate + :data:`PRV_EPS_ERROR` (its default 0.01, dominant when ε ≲ 0.5).
  It models only Poisson-subsampled Gaussians (q = 1 for ``none``): ``fixed`` gives ``None``.
- ``pld``: dp_accounting PLD, ADD_OR_REMOVE_ONE, pessimistic connect-the-dots (Doroshenko et al.,
  arXiv:2207.04380). We build exactly what ``pld.PLDAccountant`` builds for ``SelfComposedDpEvent(
  event, count)`` per entry (same calls and defaults; a test checks equality) but memoize
  single-round PLDs. ``PLDAccountant`` 0.6.0 has no branch for ``SampledWithoutReplacementDpEvent``:
  ``fixed`` gives ``None``. Grid spacing: :func:`pld_value_discretization_interval`.

Accountable range (:mod:`fedprivacy.privacy.bounds`, where the backends' measured failures are
listed; refused elsewhere by :class:`GaussianRound` and :func:`epsilon`): z = 0 (no privacy: ``inf``)
or :data:`MIN_NOISE_MULTIPLIER` <= z <= :data:`MAX_NOISE_MULTIPLIER`; q = 0 or q >=
:data:`MIN_SAMPLING_RATE`; delta in [:data:`MIN_DELTA`, 1). Within it, the grid-based backends still
grow with ε itself (PRV ran out of 24 GiB at z = 0.05, q = 1, 100 rounds, ε ≈ 28,000): where the RDP
bound (cheap, closed form) exceeds :data:`EPSILON_CEILING`, ``prv`` and ``pld`` report ``inf``
without building a grid, which over-states a guarantee that certifies nothing anyway (e^100), never
under-states it.

Reported values (:func:`epsilon`, the one place every ε passes through): never negative, never
NaN. (ε, δ)-DP implies (ε', δ)-DP for every ε' >= ε, so a raw ε < 0 is reported as 0; raw values
do go negative at large δ, once δ exceeds the privacy-loss curve's δ(0) (the total variation
distance), and RDP's conversion has the negative term :math:`\log\frac{\alpha-1}{\alpha}` (one
step at q = 1, δ = 0.5: PRV -0.364 at z = 1, RDP -0.454 at z = 2). Opacus' PRV raises ``"Cannot
compute epsilon"`` when δ is above the curve at the low end -L of its domain (L >= 3 + eps_error):
its ε is then below -3, reported as 0. ``inf`` (z = 0) stays ``inf``; a NaN certifies nothing and
is reported as ``inf``. :func:`json_epsilon` writes ``inf`` as the string ``"inf"`` for JSON
(strict JSON has no Infinity; ``float("inf")`` reads it back); CSV files hold ``inf``.

Performance (ε is recomputed every round): per-round RDP vectors and single-round PLDs are
memoized, so an entry costs a vector sum (rdp) or one FFT self-composition (pld); prv sizes Opacus'
discretization domain from the same RDP vectors (:class:`_MemoizedPRVAccountant`), leaving its
discretization and FFT composition (the quickstart's 40 per-round values, q = 0.1, z = 1: 1.3 s
instead of 17.6 s on a loaded 2-vCPU machine, 2026-11-27; the figures below predate it). Measured on
CPU, warm cache (cold in brackets), 1 entry x 1500 rounds / 40 distinct entries (1500 rounds):
q = 100/342477, z = 1: rdp 0.05 ms (10 ms) / 0.2 ms (0.3 s); pld 0.13 s (0.45 s) / 3.4 s (12 s);
prv 0.12 s / 3.5 s. q = 0.05, z = 0.3 (ε ≈ 300): rdp < 1 ms / (2.9 s cold); pld 0.15 s / 2.0 s;
prv 4.5 s / 160 s. Opacus PRV's grid grows with ε: prefer rdp/pld per round at large ε.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import math
import numbers
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Literal, get_args

import dp_accounting
import numpy as np
from dp_accounting import rdp as dp_rdp
from dp_accounting.pld import privacy_loss_distribution as pld_lib
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis import rdp as opacus_rdp
from opacus.accountants.analysis.prv import Domain

from fedprivacy.privacy.bounds import (EPSILON_CEILING, MAX_NOISE_MULTIPLIER, MIN_DELTA, MIN_NOISE_MULTIPLIER,
                                       MIN_SAMPLING_RATE)
from fedprivacy.privacy.events import AccountedEvent, event_from_dict, event_to_dict, is_registered, register_event
from fedprivacy.privacy.skellam_accounting import SkellamRound  # noqa: F401  (registers it: any ledger may hold it)

log = logging.getLogger(__name__)

Sampling = Literal["poisson", "fixed", "none"]
AccountantKind = Literal["rdp", "prv", "pld"]

ADADPS_RDP_ORDERS: tuple[float, ...] = (
    (1.1, 1.2, 1.25, 1.5, 1.75, 2.0, 2.25, 2.5, 3.0, 3.25, 3.5, 3.75, 4.0, 4.25, 4.5, 4.75)
    + tuple(5.0 + 0.5 * i for i in range(118))  # numpy.arange(5, 64, 0.5)
    + (128.0, 256.0, 512.0)
)
"""RDP orders of the AdaDPS authors' code (Li et al., arXiv:2202.05963; TF-Privacy ``compute_privacy_sgm.py``)."""

PRV_EPS_ERROR = 0.01
"""Additive ε slack of the Opacus PRV upper bound (``PRVAccountant.get_epsilon`` default)."""

_OPACUS_ORDERS = tuple(float(a) for a in RDPAccountant.DEFAULT_ALPHAS)
"""Opacus ``RDPAccountant``'s orders, the default of :func:`epsilon` and the ones its PRV domain is sized with."""

_ADD_REMOVE = dp_accounting.NeighboringRelation.ADD_OR_REMOVE_ONE
_REPLACE_ONE = dp_accounting.NeighboringRelation.REPLACE_ONE


def _is_real(x: Any) -> bool:
    try:
        return isinstance(x, numbers.Real) and not isinstance(x, bool) and math.isfinite(x)
    except OverflowError:  # an int beyond float's range (valid JSON)
        return False


def _is_int(x: Any, minimum: int) -> bool:
    return isinstance(x, numbers.Integral) and not isinstance(x, bool) and int(x) >= minimum


@register_event
@dataclasses.dataclass(frozen=True)
class GaussianRound:
    """One round's release: Gaussian noise multiplier z (std / sensitivity) on a sum over a sampled cohort.

    Attributes:
        noise_multiplier: z = noise std / C, with C the per-user clip norm; 0 means non-private.
        sampling: how the cohort was drawn (see the module docstring).
        population: N, the FULL population the sampler draws from.
        expected_cohort: poisson: q·N (any real in [0, N]); fixed: m (integer-valued); none: N.

    Raises:
        ValueError: a field is out of range (the message names it). Valid fields are stored as
            plain ``float``/``int`` so rounds hash, compare and serialize alike.
    """

    noise_multiplier: float
    sampling: Sampling
    population: int
    expected_cohort: float

    def __post_init__(self) -> None:
        name = type(self).__name__
        z = self.noise_multiplier
        if not _is_real(z) or not (z == 0 or MIN_NOISE_MULTIPLIER <= z <= MAX_NOISE_MULTIPLIER):
            raise ValueError(f"{name}.noise_multiplier must be 0 or in [{MIN_NOISE_MULTIPLIER}, {MAX_NOISE_MULTIPLIER:g}] "
                             f"(what the accountants compute), got {z!r}")
        if self.sampling not in get_args(Sampling):
            raise ValueError(f"{name}.sampling must be one of {get_args(Sampling)}, got {self.sampling!r}")
        if not _is_int(self.population, 1):
            raise ValueError(f"{name}.population must be an integer >= 1, got {self.population!r}")
        m = self.expected_cohort
        if not _is_real(m) or not 0 <= m <= self.population:
            raise ValueError(f"{name}.expected_cohort must be a number in [0, population={self.population}], got {m!r}")
        if self.sampling == "fixed" and not float(m).is_integer():
            raise ValueError(f"{name}.expected_cohort must be an integer m for sampling='fixed', got {m!r}")
        if self.sampling == "none" and m != self.population:
            raise ValueError(f"{name}.expected_cohort must equal population={self.population} for sampling='none', "
                             f"got {m!r}")
        if 0 < m / self.population < MIN_SAMPLING_RATE:
            raise ValueError(f"{name}.expected_cohort / population must be 0 or >= {MIN_SAMPLING_RATE:g} (what the "
                             f"accountants compute), got {m!r} / {self.population}")
        for field, cast in (("noise_multiplier", float), ("population", int), ("expected_cohort", float)):
            object.__setattr__(self, field, cast(getattr(self, field)))

    @property
    def q(self) -> float:
        """Sampling rate q = expected_cohort / population (1 for ``none``)."""
        return self.expected_cohort / self.population

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        """REPLACE_ONE for ``fixed`` (sensitivity 2C), ADD_OR_REMOVE_ONE otherwise (sensitivity C)."""
        return _REPLACE_ONE if self.sampling == "fixed" else _ADD_REMOVE

    def dp_event(self) -> dp_accounting.DpEvent:
        """The dp_accounting event of this round (``GaussianDpEvent`` semantics: z = s / C).

        Note: composing the ``fixed`` event into dp_accounting 0.6.0's ``RdpAccountant`` as is
        under-accounts (an upstream dp_accounting bug); :func:`epsilon` composes it with z / 2.
        """
        gaussian = dp_accounting.GaussianDpEvent(self.noise_multiplier)
        if self.sampling == "poisson":
            return dp_accounting.PoissonSampledDpEvent(self.q, gaussian)
        if self.sampling == "fixed":
            return dp_accounting.SampledWithoutReplacementDpEvent(self.population, int(self.expected_cohort), gaussian)
        return gaussian


@register_event
@dataclasses.dataclass(frozen=True)
class MatrixMechanismRun:
    """A whole horizon of a correlated-noise (matrix factorization) mechanism, accounted at its first release:
    ONE Gaussian mechanism of multiplier ``z`` on ``C x`` (:mod:`fedprivacy.privacy.matrix_factorization`; the
    noise is scaled by the strategy's sensitivity under ``participations`` releases ``separation`` apart).

    Attributes:
        noise_multiplier: z, in units of the strategy's sensitivity times the clip norm.
        mechanism: ``tree``, ``bandmf`` or ``blt`` (what the release log and the ledger name).
        horizon, separation, participations: the releases covered, the min separation ``b``, and ``k``.
    """

    noise_multiplier: float
    mechanism: str
    horizon: int
    separation: int
    participations: int

    def __post_init__(self) -> None:
        z = self.noise_multiplier
        if not _is_real(z) or not (z == 0 or MIN_NOISE_MULTIPLIER <= z <= MAX_NOISE_MULTIPLIER):
            raise ValueError(f"MatrixMechanismRun.noise_multiplier must be 0 or in [{MIN_NOISE_MULTIPLIER}, "
                             f"{MAX_NOISE_MULTIPLIER:g}], got {z!r}")
        if not isinstance(self.mechanism, str):
            raise ValueError(f"MatrixMechanismRun.mechanism must be a name, got {self.mechanism!r}")
        for field in ("horizon", "separation", "participations"):
            if not _is_int(getattr(self, field), 1):
                raise ValueError(f"MatrixMechanismRun.{field} must be an integer >= 1, got {getattr(self, field)!r}")
        object.__setattr__(self, "noise_multiplier", float(z))

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        """Add/remove one user (the sensitivity counts one user's participations)."""
        return _ADD_REMOVE

    def dp_event(self) -> dp_accounting.DpEvent:
        """``GaussianDpEvent(z)``: the horizon's releases are post-processing of one Gaussian release."""
        return dp_accounting.GaussianDpEvent(self.noise_multiplier)


@register_event
@dataclasses.dataclass(frozen=True)
class CoveredRelease:
    """A release already accounted by an earlier event: of its correlated mechanism's horizon
    (:class:`MatrixMechanismRun`) or of its participation cycle (a min-separated or cyclic Poisson schedule,
    whose cycle start composes the one participation a user can have in the cycle). Composes nothing.

    Attributes:
        noise_multiplier: z of the run (what a stream restarting here accounts its new horizon with).
        by: what covers it (``cycle`` or the mechanism's name).
    """

    noise_multiplier: float
    by: str

    def __post_init__(self) -> None:
        if not _is_real(self.noise_multiplier) or self.noise_multiplier < 0 or not isinstance(self.by, str):
            raise ValueError(f"CoveredRelease: noise_multiplier must be a real >= 0 and by a name, got "
                             f"{self.noise_multiplier!r}, {self.by!r}")
        object.__setattr__(self, "noise_multiplier", float(self.noise_multiplier))

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        return _ADD_REMOVE

    def dp_event(self) -> dp_accounting.DpEvent:
        return dp_accounting.NoOpDpEvent()


Entry = tuple[AccountedEvent, int]
_STATE_VERSION = 1


class PrivacyLedger:
    """Ordered run-length list of ``(event, count)``: the single source of truth.

    The events are registered accounted events (:mod:`fedprivacy.privacy.events`; fedprivacy's own:
    :class:`GaussianRound`). Consecutive equal events are merged. All must share one neighbouring relation
    (``fixed`` is replace-one; ``poisson`` and ``none`` are add/remove-one), since a guarantee
    composed across relations would be meaningless.
    """

    def __init__(self, entries: Iterable[Entry] = ()) -> None:
        self._entries: list[Entry] = []
        for rnd, count in entries:
            self.compose(rnd, count)

    def compose(self, rnd: AccountedEvent, count: int = 1) -> PrivacyLedger:
        """Append ``count`` releases of ``rnd``; returns ``self``.

        Raises:
            TypeError: ``rnd`` is not a registered accounted event (:func:`~fedprivacy.privacy.events.register_event`).
            ValueError: ``count`` < 1, or ``rnd``'s neighbouring relation differs from the ledger's.
        """
        if not is_registered(rnd):
            raise TypeError(f"PrivacyLedger.compose expects a registered accounted event, got {type(rnd).__name__}")
        if not _is_int(count, 1):
            raise ValueError(f"PrivacyLedger.compose: count must be an integer >= 1, got {count!r}")
        first = self._entries[0][0] if self._entries else rnd
        if first.neighboring_relation != rnd.neighboring_relation:
            raise ValueError(f"PrivacyLedger.compose: {_describe(rnd)} cannot be composed with {_describe(first)} "
                             "(neighbouring relations differ)")
        if self._entries and self._entries[-1][0] == rnd:
            self._entries[-1] = (rnd, self._entries[-1][1] + int(count))
        else:
            self._entries.append((rnd, int(count)))
        return self

    @property
    def entries(self) -> tuple[Entry, ...]:
        """The run-length entries, in composition order."""
        return tuple(self._entries)

    @property
    def rounds(self) -> int:
        """Total number of composed rounds."""
        return sum(count for _, count in self._entries)

    def state_dict(self) -> dict[str, Any]:
        """JSON-able state: ``{"version": 1, "entries": [{"type", "count", <event fields>}, ...]}``
        (:func:`~fedprivacy.privacy.events.event_to_dict` plus the count)."""
        return {"version": _STATE_VERSION,
                "entries": [{**event_to_dict(rnd), "count": count} for rnd, count in self._entries]}

    @classmethod
    def from_state_dict(cls, state: Mapping[str, Any]) -> PrivacyLedger:
        """Rebuild a ledger from :meth:`state_dict` output, through the registry of event types (an allow-list).

        Raises:
            ValueError: wrong version, unknown event type, or missing/unexpected fields (naming the entry).
        """
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION \
                or not isinstance(state.get("entries"), list):
            raise ValueError(f"PrivacyLedger state must be a mapping with version={_STATE_VERSION} and entries")
        ledger = cls()
        for i, item in enumerate(state["entries"]):
            if not isinstance(item, Mapping) or "count" not in item:
                raise ValueError(f"PrivacyLedger entry {i}: expected fields type, count and the event's, got {item!r}")
            try:
                event = event_from_dict({k: v for k, v in item.items() if k != "count"})
            except ValueError as err:
                raise ValueError(f"PrivacyLedger entry {i}: {err}") from None
            ledger.compose(event, item["count"])
        return ledger


def _describe(event: AccountedEvent) -> str:
    return f"sampling={event.sampling!r}" if isinstance(event, GaussianRound) else type(event).__name__


def pld_value_discretization_interval(rounds: Iterable[GaussianRound]) -> float:
    r"""PLD grid spacing: a tenth of the smallest single-round privacy-loss spread, clipped.

    .. math:: s(q, z) = \min\bigl(q\sqrt{e^{1/z^2}-1},\ 1/z\bigr),\qquad
              h = \operatorname{clip}\bigl(0.1\,\min_r s(q_r, z_r),\ 10^{-5},\ 10^{-3}\bigr)

    :math:`q\sqrt{e^{1/z^2}-1}` is the square root of the χ²-divergence of the Poisson-subsampled
    Gaussian from the plain one, :math:`1/z` the std of the unsampled Gaussian privacy loss. The
    discretization error is set by h relative to that spread (a fixed h = 1e-3 overstates ε by 32%
    at q = 100/342477, z = 1, T = 1500). Measured against h = 1e-5 over q ∈ [1e-4, 0.3],
    z ∈ [0.3, 5], T ∈ [10, 1e5]: relative error ≤ 1e-3, at ≤ 0.6 s per cold call. The floor
    bounds grid size for q ≲ 1e-4 (coarser there).

    Args:
        rounds: the rounds to compose (only those with q > 0 and z > 0 matter).

    Returns:
        The ``value_discretization_interval`` shared by every PLD of one composition.
    """
    spreads = [min(r.q * math.sqrt(math.expm1(min(r.noise_multiplier ** -2, 700.0))), 1.0 / r.noise_multiplier)
               for r in rounds if r.q > 0 and r.noise_multiplier > 0]
    return min(max(0.1 * min(spreads, default=1.0), 1e-5), 1e-3)


@functools.lru_cache(maxsize=4096)
def _rdp_per_round(rnd: AccountedEvent, orders: tuple[float, ...]) -> np.ndarray:
    """RDP of one release at each order, under its neighbouring relation (read-only, memoized): Opacus' for a
    Poisson :class:`GaussianRound`, dp_accounting's ``RdpAccountant`` on its ``DpEvent`` for any other event."""
    if hasattr(rnd, "rdp"):  # an event that states its own RDP curve (e.g. Skellam: no DpEvent models it)
        rdp = np.array(rnd.rdp(orders), dtype=np.float64)
    elif not isinstance(rnd, GaussianRound):
        accountant = dp_rdp.RdpAccountant(orders, neighboring_relation=rnd.neighboring_relation)
        rdp = np.array(accountant.compose(rnd.dp_event()).rdp, dtype=np.float64)
    elif rnd.sampling == "fixed":
        # Replace-one sensitivity of a clipped sum is 2C: compose z / 2 (an upstream dp_accounting bug, see module doc).
        event = dp_accounting.SampledWithoutReplacementDpEvent(
            rnd.population, int(rnd.expected_cohort), dp_accounting.GaussianDpEvent(rnd.noise_multiplier / 2))
        rdp = dp_rdp.RdpAccountant(orders, neighboring_relation=_REPLACE_ONE).compose(event).rdp
    else:
        rdp = np.asarray(opacus_rdp.compute_rdp(q=rnd.q, noise_multiplier=rnd.noise_multiplier, steps=1,
                                                orders=list(orders)), dtype=np.float64)
    rdp.setflags(write=False)
    return rdp


@functools.lru_cache(maxsize=256)
def _poisson_round_pld(q: float, noise_multiplier: float, interval: float) -> pld_lib.PrivacyLossDistribution:
    """The single-round PLD ``PLDAccountant`` builds for ``PoissonSampledDpEvent(q, Gaussian(z))`` (memoized)."""
    return pld_lib.from_gaussian_mechanism(standard_deviation=noise_multiplier, value_discretization_interval=interval,
                                           sampling_prob=q, neighboring_relation=_ADD_REMOVE)


def _rdp_epsilon(entries: Sequence[Entry], delta: float, orders: tuple[float, ...]) -> float:
    rdp = sum(count * _rdp_per_round(rnd, orders) for rnd, count in entries)
    if entries[0][0].neighboring_relation == _REPLACE_ONE:
        eps, _ = dp_rdp.compute_epsilon(orders, rdp, delta)
    else:
        eps, _ = opacus_rdp.get_privacy_spent(orders=list(orders), rdp=rdp, delta=delta)
    return float(eps)


def _gaussian_rounds(entries: Sequence[Entry]) -> list[tuple[GaussianRound, int]]:
    """``entries``, every one a :class:`GaussianRound` (the Opacus PRV and memoized PLD paths model only those)."""
    rounds = [(rnd, count) for rnd, count in entries if isinstance(rnd, GaussianRound)]
    assert len(rounds) == len(entries), "not every event is a GaussianRound"
    return rounds


class _MemoizedPRVAccountant(PRVAccountant):
    """Opacus' ``PRVAccountant`` on a ledger's Gaussian rounds, its discretization domain built from the memoized
    per-round RDP vectors (:func:`_rdp_per_round`) instead of recomputed ones; bit for bit the same ε (a test checks).

    Opacus' ``compute_safe_domain_size`` (Gopi, Lee, Wutschitz, arXiv:2106.02848, Remark 5.6, as in the authors'
    code) truncates the privacy loss to [-L, L] with L = max(ε_RDP(all rounds; δ_err / 4), max over entries of
    ε_RDP(one round; δ_err / (8 T)), ε_err) + 3, T the number of rounds, and meshes it at
    ε_err / sqrt(T log(12 / δ_err) / 2). Opacus computes both RDP ε afresh from Mironov's series (arXiv:1908.10530,
    §3.3) at its 150 orders, which is 90% of a PRV ε at 40 rounds; here they sum the cached vectors, so a run that
    reports the PRV ε every round pays that series once per distinct round.
    """

    def __init__(self, rounds: Sequence[tuple[GaussianRound, int]]) -> None:
        super().__init__()
        self.rounds = list(rounds)
        self.history = [(rnd.noise_multiplier, rnd.q, count) for rnd, count in self.rounds]

    def _get_domain(self, prvs: Sequence[Any], num_self_compositions: Sequence[int], eps_error: float,
                    delta_error: float) -> Domain:
        total = sum(num_self_compositions)
        size = max(_rdp_epsilon(self.rounds, delta_error / 4, _OPACUS_ORDERS),
                   *(_rdp_epsilon([(rnd, 1)], delta_error / (8 * total), _OPACUS_ORDERS) for rnd, _ in self.rounds))
        size = max(size, eps_error) + 3
        mesh_size = eps_error / np.sqrt(total * np.log(12 / delta_error) / 2)
        return Domain.create_aligned(-size, size, mesh_size)


def _prv_epsilon(entries: Sequence[Entry], delta: float) -> float:
    accountant = _MemoizedPRVAccountant(_gaussian_rounds(entries))
    with np.errstate(divide="ignore"):  # Opacus' PRV takes log(1 - q) = -inf at q = 1, harmlessly
        try:
            return float(accountant.get_epsilon(delta, eps_error=PRV_EPS_ERROR))
        except RuntimeError as err:  # delta above the delta-curve at the domain's low end: epsilon < -3
            if str(err) != "Cannot compute epsilon":
                raise
            return 0.0


def _pld_epsilon(entries: Sequence[Entry], delta: float) -> float:
    interval = pld_value_discretization_interval(rnd for rnd, _ in entries if isinstance(rnd, GaussianRound))
    if not all(isinstance(rnd, GaussianRound) for rnd, _ in entries):  # dp_accounting's PLD of the DpEvents
        accountant = dp_accounting.pld.PLDAccountant(_ADD_REMOVE, value_discretization_interval=interval)
        for rnd, count in entries:
            accountant.compose(rnd.dp_event(), count)
        return float(accountant.get_epsilon(delta))
    total = pld_lib.identity(value_discretization_interval=interval)
    for rnd, count in _gaussian_rounds(entries):
        if rnd.sampling == "none":  # PLDAccountant's GaussianDpEvent branch: T-fold = std z / sqrt(T)
            piece = pld_lib.from_gaussian_mechanism(
                standard_deviation=rnd.noise_multiplier / math.sqrt(count),
                value_discretization_interval=interval, neighboring_relation=_ADD_REMOVE)
        else:
            piece = _poisson_round_pld(rnd.q, rnd.noise_multiplier, interval).self_compose(count)
        total = total.compose(piece)
    return float(total.get_epsilon_for_delta(delta))


def _as_ledger(ledger_or_entries: PrivacyLedger | Iterable[Entry]) -> PrivacyLedger:
    return ledger_or_entries if isinstance(ledger_or_entries, PrivacyLedger) else PrivacyLedger(ledger_or_entries)


def _composed(ledger: PrivacyLedger) -> tuple[Entry, ...]:
    """The ledger's entries without :class:`CoveredRelease` (it composes nothing), equal neighbours merged."""
    return PrivacyLedger((rnd, count) for rnd, count in ledger.entries if not isinstance(rnd, CoveredRelease)).entries


def accounts(ledger_or_entries: PrivacyLedger | Iterable[Entry], kind: AccountantKind) -> bool:
    """Whether ``kind`` computes an epsilon for this ledger (:func:`epsilon` reports None exactly where it does not):
    replace-one ledgers (``fixed``) by rdp only, events other than :class:`GaussianRound` not by prv, events that
    state their own RDP curve by rdp only."""
    ledger = _as_ledger(ledger_or_entries)
    if ledger.entries and ledger.entries[0][0].neighboring_relation == _REPLACE_ONE and kind != "rdp":
        return False
    entries = _composed(ledger)
    return not ((kind == "prv" and not all(isinstance(rnd, GaussianRound) for rnd, _ in entries))
                or (kind != "rdp" and any(hasattr(rnd, "rdp") for rnd, _ in entries)))


def epsilon(ledger_or_entries: PrivacyLedger | Iterable[Entry], delta: float, kind: AccountantKind, *,
            rdp_orders: Sequence[float] | None = None) -> float | None:
    """ε at ``delta`` of all composed rounds, under accountant ``kind``.

    Events other than :class:`GaussianRound` are accounted from their ``DpEvent`` (rdp: dp_accounting's
    ``RdpAccountant``, its RDP added to the Gaussian rounds'; pld: dp_accounting's ``PLDAccountant`` over all of
    them; prv: not modelled, ``None``), or from the RDP curve an event states itself (its ``rdp(orders)``, e.g.
    :class:`~fedprivacy.privacy.skellam.SkellamRound`; pld and prv: ``None``), except :class:`CoveredRelease`, which composes nothing (dropped, so that the
    equal events around it merge into one entry).

    Args:
        ledger_or_entries: a :class:`PrivacyLedger` or ``(event, count)`` pairs, in order.
        delta: target δ in (0, 1).
        kind: ``"rdp"``, ``"prv"`` or ``"pld"`` (see the module docstring).
        rdp_orders: RDP orders for ``kind="rdp"`` (default: Opacus ``RDPAccountant.DEFAULT_ALPHAS``);
            ignored by the other kinds.

    Returns:
        ε >= 0 (``0.0`` for an empty ledger or only q = 0 rounds; ``inf`` if a sampled round has
        z = 0; never NaN: module docstring, "Reported values"), or ``None`` when ``kind`` cannot account
        the ledger (replace-one, e.g. ``fixed``, with prv/pld; events other than Gaussian rounds with prv).

    Raises:
        ValueError: bad ``delta``, ``kind`` or ``rdp_orders``.
    """
    if not _is_real(delta) or not MIN_DELTA <= delta < 1:
        raise ValueError(f"delta must be in [{MIN_DELTA:g}, 1), got {delta!r}")
    if kind not in get_args(AccountantKind):
        raise ValueError(f"accountant kind must be one of {get_args(AccountantKind)}, got {kind!r}")
    orders = _OPACUS_ORDERS if rdp_orders is None else tuple(float(a) for a in rdp_orders)
    if not orders or not all(math.isfinite(a) and a > 1 for a in orders):
        raise ValueError(f"rdp_orders must be a non-empty list of finite orders > 1, got {rdp_orders!r}")
    ledger = _as_ledger(ledger_or_entries)
    if not accounts(ledger, kind):
        return None
    # CoveredRelease composes nothing: dropped, the entries around it merge (a cyclic ledger's cycle starts become
    # one entry, one PLD composition), in order (the result is bit for bit what PLDAccountant builds for them)
    entries = _composed(ledger)
    gaussian = [rnd for rnd, _ in entries if isinstance(rnd, GaussianRound)]
    active = [(rnd, count) for rnd, count in entries if not isinstance(rnd, GaussianRound) or rnd.q > 0]
    if not active:
        return 0.0
    if any(rnd.noise_multiplier == 0 and rnd.q > 0 for rnd in gaussian) or any(
            isinstance(rnd, MatrixMechanismRun) and rnd.noise_multiplier == 0 for rnd, _ in active):
        return math.inf
    if kind != "rdp" and _rdp_epsilon(active, delta, orders) > EPSILON_CEILING:
        return math.inf  # module docstring, "Accountable range": no grid for a guarantee beyond e^100
    raw = (_rdp_epsilon(active, delta, orders) if kind == "rdp"
           else _prv_epsilon(active, delta) if kind == "prv" else _pld_epsilon(active, delta))
    return math.inf if math.isnan(raw) else max(0.0, raw)  # module docstring, "Reported values"


def resolve_delta(delta: float | None, population: int, name: str = "delta") -> float:
    """The run's delta: ``delta``, or ``1 / population`` when None; checked BEFORE anything is released.

    A delta of at least 1/N (the default's 1/N included) is allowed but logged as a WARNING: the mechanism
    that publishes each user's data in full with probability delta is (0, delta)-DP and publishes
    N delta >= 1 users in expectation (Dwork & Roth 2014, §2.3), so such a guarantee permits exactly that.

    Raises:
        ValueError: the delta is not in [MIN_DELTA, 1) (e.g. the default for ``population`` = 1), naming ``name``.
    """
    value = 1.0 / population if delta is None else delta
    if not _is_real(value) or not MIN_DELTA <= value < 1:
        default = f" (its default 1 / population, population={population})" if delta is None else ""
        raise ValueError(f"{name} must be in [{MIN_DELTA:g}, 1){default}, got {value!r}")
    if value >= 1.0 / population:
        log.warning("%s=%.3g >= 1/population (1/%d): a guarantee with such a delta permits publishing a random "
                    "user's data in full (each user with probability delta: %.3g user(s) in expectation; Dwork & "
                    "Roth 2014, §2.3); choose a delta well below 1/population", name, value, population,
                    value * population)
    return value


def json_epsilon(eps: float | None) -> float | str | None:
    """``eps`` for strict JSON: ``inf`` as the string ``"inf"``, anything else (a finite ε, ``None``) as is."""
    return "inf" if eps == math.inf else eps


def epsilons(ledger: PrivacyLedger | Iterable[Entry], delta: float, kinds: Iterable[AccountantKind],
             rdp_orders: Sequence[float] | None = None) -> dict[str, float | None]:
    """:func:`epsilon` under each of ``kinds``, keyed by kind."""
    ledger = _as_ledger(ledger)
    return {kind: epsilon(ledger, delta, kind, rdp_orders=rdp_orders) for kind in kinds}


def would_exceed(ledger: PrivacyLedger | Iterable[Entry], next_round: AccountedEvent, delta: float,
                 kind: AccountantKind, max_epsilon: float, rdp_orders: Sequence[float] | None = None) -> bool:
    """Whether running ``next_round`` would take ε above ``max_epsilon`` (invariant 8: ask BEFORE the round).

    Raises:
        ValueError: ``kind`` cannot account this sampling (a budget that cannot be checked is refused).
    """
    eps = epsilon(PrivacyLedger(_as_ledger(ledger).entries).compose(next_round), delta, kind, rdp_orders=rdp_orders)
    if eps is None:
        raise ValueError(f"accountant {kind!r} cannot account {_describe(next_round)}; budget with 'rdp'")
    return eps > max_epsilon


def epsilon_for(sampling: Sampling, q: float, noise_multiplier: float, steps: int, delta: float,
                kind: AccountantKind, population: int | None = None,
                rdp_orders: Sequence[float] | None = None) -> float | None:
    """ε of ``steps`` identical rounds (CLI convenience over :func:`epsilon`).

    Args:
        sampling: ``poisson`` (rate q), ``fixed`` (m = round(q·N) of N), or ``none`` (q must be 1).
        q: sampling rate in [0, 1].
        noise_multiplier: z = noise std / C.
        steps: number of rounds, >= 0.
        delta: target δ.
        kind: accountant kind.
        population: N; required for ``fixed``; for ``poisson`` it only fixes the representation q·N / N.
        rdp_orders: as in :func:`epsilon`.

    Raises:
        ValueError: bad ``q`` or ``steps``, ``fixed`` without ``population``, ``none`` with q != 1.
    """
    if not _is_real(q) or not 0 <= q <= 1:
        raise ValueError(f"q must be in [0, 1], got {q!r}")
    if not _is_int(steps, 0):
        raise ValueError(f"steps must be an integer >= 0, got {steps!r}")
    if sampling == "fixed" and population is None:
        raise ValueError("population is required for sampling='fixed' (the cohort is m = round(q * population))")
    if sampling == "none" and q != 1:
        raise ValueError(f"sampling='none' means every user every round: q must be 1, got {q!r}")
    n = 1 if population is None else population  # poisson/none without N: q = (q * 1) / 1 exactly
    rnd = GaussianRound(noise_multiplier, sampling, n, round(q * n) if sampling == "fixed" else q * n)
    ledger = PrivacyLedger([(rnd, steps)] if steps else [])
    return epsilon(ledger, delta, kind, rdp_orders=rdp_orders)
