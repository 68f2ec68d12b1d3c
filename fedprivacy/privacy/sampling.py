"""Cohort samplers over the FULL population, each paired with its accounting event (invariant 5).

- :class:`PoissonSampler`: every user joins independently with probability ``q = m / N``; the
  cohort size is random (mean ``m``). Accounted as ``PoissonSampledDpEvent`` (add/remove-one).
- :class:`FixedSizeSampler`: exactly ``m`` of ``N`` users without replacement. Accounted as
  ``SampledWithoutReplacementDpEvent`` (replace-one neighbours).

Both draw from their own ``numpy`` generator whose state is checkpointed: seeded from the run seed
(reproducible, predictable by whoever knows it) or, ``secure=True``, from the OS's cryptographic
source, so that the cohort is as secret as the amplification by sampling assumes.

Both are participation schedules (:class:`ParticipationSchedule`), named in :data:`SCHEDULES`: a schedule whose cohort depends on
the round (cyclic participation: ``b`` groups in turn, Poisson within a group; min-separated participation)
keeps its position in its state and pairs itself with the event its participation is accounted as.
"""

from __future__ import annotations

import secrets
from typing import Any, Protocol

import numpy as np

from fedprivacy.privacy.accounting import GaussianRound, Sampling
from fedprivacy.privacy.events import AccountedEvent

SAMPLING_STREAM = 0x73616D706C65  # "sample"


class ParticipationSchedule(Protocol):
    """Who participates in each round, and what that is accounted as (module docstring). Built as
    ``cls(population, expected_cohort, seed, secure)``; :meth:`sample` is called once per round, in order."""

    @property
    def kind(self) -> str:
        """Its name in :data:`SCHEDULES`."""

    def sample(self) -> np.ndarray:
        """Sorted indices into ``0..population-1`` of this round's cohort."""

    def round_event(self, noise_multiplier: float) -> AccountedEvent:
        """The event of one round released with independent Gaussian noise of multiplier ``noise_multiplier``."""

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state: dict[str, Any]) -> None: ...


class _Sampler:
    kind: Sampling

    def __init__(self, population: int, expected_cohort: int, seed: int, secure: bool = False) -> None:
        if population < 1:
            raise ValueError(f"population must be >= 1, got {population}")
        if not 1 <= expected_cohort <= population:
            raise ValueError(
                f"privacy.expected_cohort={expected_cohort} must be between 1 and the population ({population})"
            )
        self.population = population
        self.expected_cohort = expected_cohort
        entropy = secrets.randbits(128) if secure else [seed, SAMPLING_STREAM]
        self._rng = np.random.default_rng(np.random.SeedSequence(entropy))

    def round_event(self, noise_multiplier: float) -> GaussianRound:
        """The accounting event of one round released with this sampler."""
        return GaussianRound(
            noise_multiplier=noise_multiplier,
            sampling=self.kind,
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

    def sample(self) -> np.ndarray:
        """Sorted indices of this round's cohort (possibly empty)."""
        q = self.expected_cohort / self.population
        return np.flatnonzero(self._rng.random(self.population) < q)


class FixedSizeSampler(_Sampler):
    """Exactly ``expected_cohort`` users, uniformly without replacement."""

    kind = "fixed"

    def sample(self) -> np.ndarray:
        return np.sort(self._rng.choice(self.population, size=self.expected_cohort, replace=False))


SCHEDULES: dict[str, type[PoissonSampler] | type[FixedSizeSampler]] = {"poisson": PoissonSampler,
                                                                       "fixed": FixedSizeSampler}
"""The participation schedules ``privacy.sampling`` names."""


def make_sampler(kind: str, population: int, expected_cohort: int, seed: int,
                 secure: bool = False) -> ParticipationSchedule:
    """Build the schedule named in ``privacy.sampling`` (``secure``: seeded from the OS, not ``seed``)."""
    if kind not in SCHEDULES:
        raise ValueError(f"sampling must be one of {sorted(SCHEDULES)}, got {kind!r}")
    return SCHEDULES[kind](population, expected_cohort, seed, secure)
