"""Cohort samplers over the FULL population, each paired with its accounting event (invariant 5).

- :class:`PoissonSampler`: every user joins independently with probability ``q = m / N``; the
  cohort size is random (mean ``m``). Accounted as ``PoissonSampledDpEvent`` (add/remove-one).
- :class:`FixedSizeSampler`: exactly ``m`` of ``N`` users without replacement. Accounted as
  ``SampledWithoutReplacementDpEvent`` (replace-one neighbours).

Both draw from their own ``numpy`` generator whose state is checkpointed: seeded from the run seed
(reproducible, predictable by whoever knows it) or, ``secure=True``, from the OS's cryptographic
source, so that the cohort is as secret as the amplification by sampling assumes.

Schedules whose cohort depends on the release (``b = groups``; user ``i`` is in group ``i mod b``, release ``k``
samples group ``(k - 1) mod b``, so one user's participations are at least ``b`` releases apart and at most
``ceil(T / b)`` in ``T`` releases; the group follows the release number, which a resume keeps, and user ``i`` is
the ``i``-th of the population's order, which the strategy keeps by each node's identity, not its node id:
:meth:`fedprivacy.fl.strategy.DPFedAvg._population`):

- :class:`CyclicPoissonSampler`: within the group, each user w.p. ``q = m b / N`` (Choquette-Choo et al. 2023,
  arXiv:2306.08153, §4, "cyclic Poisson"). Accounted per cycle: its first release composes
  ``PoissonSampledDpEvent(q, GaussianDpEvent(z))`` (a user is in at most one release of a cycle), the others
  compose nothing (:class:`~fedprivacy.privacy.accounting.CoveredRelease`).
- :class:`MinSeparatedSampler`: within the group, ``m`` users uniformly without replacement. Accounted per
  cycle without amplification: ``GaussianDpEvent(z)`` at its first release.

All are participation schedules (:class:`ParticipationSchedule`), named in :data:`SCHEDULES`. A schedule of one's
own is a factory called with the same arguments (:data:`ScheduleFactory`; ``DPFedAvg(sampling=factory)``,
``privacy.sampling: package.module:factory``): its :meth:`~ParticipationSchedule.round_event` is what the ledger
composes, so it carries its own accounting, and its :attr:`~ParticipationSchedule.separation` is what the rules that
depend on the schedule ask (a bounded one keeps its users by identity across restarts; a correlated-noise stream
needs the separation its sensitivity counts participations by, ``b``).
"""

from __future__ import annotations

import abc
import secrets
from collections.abc import Callable
from typing import Any, Literal, Protocol

import numpy as np

from fedprivacy.privacy.accounting import CoveredRelease, GaussianRound
from fedprivacy.privacy.events import AccountedEvent

SAMPLING_STREAM = 0x73616D706C65  # "sample"

Schedule = Literal["poisson", "fixed", "cyclic_poisson", "min_separated"]
"""The participation schedules' names (:data:`SCHEDULES`)."""


class ParticipationSchedule(Protocol):
    """Who participates in each round, and what that is accounted as (module docstring). Built by a
    :data:`ScheduleFactory`; :meth:`sample` is called once per round, in order, with the number of the release the
    round makes, and :meth:`round_event` for every release the ledger composes (also ahead of it: the budget check,
    the planned ledger), so it must not draw. A seeded simulation checkpoints :meth:`state_dict` and a resume
    restores it (from the OS, ``secure``, nothing is kept and a resume builds a fresh one)."""

    @property
    def kind(self) -> str:
        """Its name in :data:`SCHEDULES` (a schedule of one's own: any name, used in messages)."""

    @property
    def separation(self) -> int | None:
        """The fewest releases between two participations of one user (None: unbounded). Bounded: the strategy keeps
        the population's order by identity across restarts (user ``i`` stays user ``i``), and a correlated-noise
        stream may check it against its own (``check_schedule``)."""

    def sample(self, release: int) -> np.ndarray:
        """Sorted indices into ``0..population-1`` of the cohort of the round making release ``release``."""

    def round_event(self, noise_multiplier: float, release: int) -> AccountedEvent:
        """The event of release ``release`` made with independent Gaussian noise of multiplier ``noise_multiplier``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Sampler(abc.ABC):
    kind: Schedule
    separation: int | None = None

    def __init__(self, population: int, expected_cohort: int, seed: int, secure: bool = False,
                 groups: int = 1) -> None:
        if population < 1:
            raise ValueError(f"population must be >= 1, got {population}")
        if not 1 <= expected_cohort <= population:
            raise ValueError(
                f"privacy.expected_cohort={expected_cohort} must be between 1 and the population ({population})"
            )
        if groups != 1:
            raise ValueError(f"privacy.groups={groups} needs a cyclic privacy.sampling (cyclic_poisson, "
                             f"min_separated), got {self.kind!r}")
        self.population = population
        self.expected_cohort = expected_cohort
        entropy = secrets.randbits(128) if secure else [seed, SAMPLING_STREAM]
        self._rng = np.random.default_rng(np.random.SeedSequence(entropy))

    @abc.abstractmethod
    def sample(self, release: int = 1) -> np.ndarray:
        """Sorted indices of the cohort of the round making release ``release``."""

    def round_event(self, noise_multiplier: float, release: int = 1) -> AccountedEvent:
        """The accounting event of one round released with this sampler (the same every release)."""
        return GaussianRound(
            noise_multiplier=noise_multiplier,
            sampling=self.kind,  # type: ignore[arg-type]
            population=self.population,
            expected_cohort=float(self.expected_cohort),
        )

    def state_dict(self) -> dict:
        return {"bit_generator": self._rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self._rng.bit_generator.state = state["bit_generator"]


class PoissonSampler(_Sampler):
    """Independent inclusion with probability ``q = expected_cohort / population``."""

    kind = "poisson"

    def sample(self, release: int = 1) -> np.ndarray:
        """Sorted indices of this round's cohort (possibly empty)."""
        q = self.expected_cohort / self.population
        return np.flatnonzero(self._rng.random(self.population) < q)


class FixedSizeSampler(_Sampler):
    """Exactly ``expected_cohort`` users, uniformly without replacement."""

    kind = "fixed"

    def sample(self, release: int = 1) -> np.ndarray:
        return np.sort(self._rng.choice(self.population, size=self.expected_cohort, replace=False))


class _Cyclic(_Sampler):
    """``groups`` groups in turn (module docstring); subclasses sample within the group."""

    def __init__(self, population: int, expected_cohort: int, seed: int, secure: bool = False,
                 groups: int = 1) -> None:
        super().__init__(population, expected_cohort, seed, secure)
        if isinstance(groups, bool) or int(groups) != groups or not 1 <= groups <= population:
            raise ValueError(f"privacy.groups={groups!r} must be an integer in [1, population={population}]")
        if expected_cohort * groups > population:
            raise ValueError(f"privacy.expected_cohort={expected_cohort} times privacy.groups={groups} must be <= the "
                             f"population ({population}): each group of about N / groups users yields one cohort")
        self.groups = int(groups)
        self.separation = self.groups

    def group(self, release: int) -> np.ndarray:
        """The users of release ``release``'s group: ``i`` with ``i mod b = (release - 1) mod b``."""
        if release < 1:
            raise ValueError(f"release numbers start at 1, got {release}")
        return np.arange((release - 1) % self.groups, self.population, self.groups)

    def _cycle_start(self, release: int) -> bool:
        return (release - 1) % self.groups == 0


class CyclicPoissonSampler(_Cyclic):
    """Cyclic Poisson participation: Poisson with ``q = m b / N`` within the release's group."""

    kind = "cyclic_poisson"

    def sample(self, release: int = 1) -> np.ndarray:
        members = self.group(release)
        q = self.expected_cohort * self.groups / self.population
        return members[self._rng.random(len(members)) < q]

    def round_event(self, noise_multiplier: float, release: int = 1) -> AccountedEvent:
        """The cycle's ``PoissonSampled(q = m b / N, Gaussian(z))`` at its first release; covered after it."""
        if not self._cycle_start(release):
            return CoveredRelease(noise_multiplier=noise_multiplier, by="cycle")
        return GaussianRound(noise_multiplier=noise_multiplier, sampling="poisson", population=self.population,
                             expected_cohort=float(self.expected_cohort * self.groups))


class MinSeparatedSampler(_Cyclic):
    """Min-separated participation: ``m`` users uniformly without replacement from the release's group."""

    kind = "min_separated"

    def sample(self, release: int = 1) -> np.ndarray:
        members = self.group(release)
        return np.sort(self._rng.choice(members, size=min(self.expected_cohort, len(members)), replace=False))

    def round_event(self, noise_multiplier: float, release: int = 1) -> AccountedEvent:
        """The cycle's ``Gaussian(z)`` (no amplification) at its first release; covered after it."""
        if not self._cycle_start(release):
            return CoveredRelease(noise_multiplier=noise_multiplier, by="cycle")
        return GaussianRound(noise_multiplier=noise_multiplier, sampling="none", population=self.population,
                             expected_cohort=float(self.population))


ScheduleFactory = Callable[[int, int, int, bool, int], ParticipationSchedule]
"""``factory(population, expected_cohort, seed, secure, groups)``: a fresh :class:`ParticipationSchedule` over
``population`` users with expected cohort ``m``, drawing from ``seed`` (or, ``secure``, from the OS), with the
configured ``groups`` (``b``; 1 unless set). Called again after a resume that re-runs released rounds (a re-keyed
``seed``) and, with large-cohort emulation, for the emulated deployment's events (its population and cohort)."""

SCHEDULES: dict[str, type[_Sampler]] = {"poisson": PoissonSampler, "fixed": FixedSizeSampler,
                                        "cyclic_poisson": CyclicPoissonSampler,
                                        "min_separated": MinSeparatedSampler}
"""The participation schedules ``privacy.sampling`` names."""


def make_sampler(kind: str | ScheduleFactory, population: int, expected_cohort: int, seed: int,
                 secure: bool = False, groups: int = 1) -> ParticipationSchedule:
    """Build the schedule named in ``privacy.sampling``, or ``kind(population, expected_cohort, seed, secure,
    groups)`` for a :data:`ScheduleFactory` (``secure``: seeded from the OS, not ``seed``; ``groups``: the cyclic
    schedules' ``b``)."""
    if not isinstance(kind, str):
        return kind(population, expected_cohort, seed, secure, groups)
    if kind not in SCHEDULES:
        raise ValueError(f"sampling must be one of {sorted(SCHEDULES)}, got {kind!r}")
    schedule: ParticipationSchedule = SCHEDULES[kind](population, expected_cohort, seed, secure, groups)
    return schedule
