r"""One run's user-level Gaussian mechanism: what is drawn and what is accounted, from one place.

Round ``t`` (ARCHITECTURE "One round, in order", McMahan et al. 2018 Alg. 1; Andrew et al. 2021):

.. math::
    S_t &\sim \text{Poisson}(q = m/N) \text{ or } \binom{[N]}{m} \qquad \text{(:meth:`sample`)} \\
    g_t &= \frac{1}{m}\Big(\sum_{i \in S_t} \operatorname{clip}(u_i, C_t) + \mathcal N(0, z_v^2 C_t^2 I_d)\Big)
        \qquad \text{(:meth:`aggregator`, :meth:`release`)} \\
    \text{ledger} &\mathrel{+}= \text{event}_t \qquad \text{(:meth:`event`, composed by :meth:`release`)}

``z_v`` is the value noise multiplier on the SIMULATED sum: ``z`` itself, ``z m / M`` when emulating a
deployment's cohort ``M`` (pfl-research's large-cohort emulation), inflated under adaptive clipping so
that the value and the clipped-count releases compose to exactly ``z`` (Andrew et al. Thm. 1). The
event is the sampler's (its sampling, the full population ``N``, ``m``) or the emulated deployment's: the
same schedule (and ``b`` groups, for the cyclic ones) over ``N'`` users with cohort ``M``, always with noise
multiplier ``z``. Emulation scales the whole draw, so it holds for any noise stream, correlated ones included:
the deployment's average carries noise ``z C f_k / M`` and so does the simulation's (``z (m/M) C f_k / m``). Because :meth:`event`, the draw in
:meth:`release` and :meth:`phi` read the same fields, they cannot disagree.

The mechanism owns the dedicated noise generator and the cohort sampler: from the OS's cryptographic
source by default (``seed=None``: a deployment's default; nothing that rebuilds a draw is ever
persisted, so a resume draws afresh and never reuses a draw, whatever its files say), or from a
``seed`` (a reproducible simulation: its noise and cohorts can be rebuilt by anyone who knows the
seed, which is what a simulation asks for; re-keyed per epoch after a resume that re-runs released
rounds, so that no re-run reuses a logged draw),
the adaptive clip ``C_t``, the privacy ledger and, when given one, the write-ahead release log: every
release is durably logged before its noise is added (:mod:`.release_log`).

Seams. The noise is a :class:`~fedprivacy.privacy.noise.NoiseStream` (``noise_stream``, default
:class:`~fedprivacy.privacy.noise.GaussianNoise`): release ``k``'s draw, its std factor ``f_k`` (the value
std is ``z_v C_t f_k``; Phi_t reads the same factor) and its accounted event (a registered
:mod:`~fedprivacy.privacy.events` event, composed by the ledger and logged ahead by the release log) all
come from the stream, so a mechanism with noise correlated across rounds is a new stream, not an edit
here. The cohort comes from a :class:`~fedprivacy.privacy.sampling.ParticipationSchedule` (``sampling``: a name,
or a factory of one's own), and so does the event the noise stream is given (its ``round_event``): a schedule of
one's own is accounted as it says, with no edit here either. A subclass may
override :meth:`aggregator` (how updates are clipped and summed) and :meth:`privatize` (how the sum is
noised and divided); the audit's deliberately broken mechanisms (:mod:`fedprivacy.audit`) do exactly
that, so they break the real pipeline, not a copy of it.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, NamedTuple, get_args

import numpy as np
import torch

from fedprivacy.privacy.accounting import (AccountantKind, PrivacyLedger, accounts, epsilons,
                                           would_exceed)
from fedprivacy.privacy.bounds import MAX_NOISE_MULTIPLIER, MIN_NOISE_MULTIPLIER, check_noise_std
from fedprivacy.privacy.adaptive_clipping import AdaptiveClip, value_noise_multiplier
from fedprivacy.privacy.aggregation import PrivateSum
from fedprivacy.privacy.events import AccountedEvent
from fedprivacy.privacy.noise import GaussianNoise, NoiseStream, part_name, stream_name
from fedprivacy.privacy.placement import Placement, released_noise_variance
from fedprivacy.privacy.release_log import ReleaseLog, rekeyed_seed
from fedprivacy.privacy.sampling import Schedule, ScheduleFactory, make_sampler

NoiseStreamFactory = Callable[..., NoiseStream]
"""Builds a :class:`~fedprivacy.privacy.noise.NoiseStream` as ``factory(seed, device=..., secure=...)``."""


@dataclass(frozen=True)
class AdaptiveClipping:
    """Andrew et al. 2021: move C toward the ``target_quantile`` of update norms at ``learning_rate``,
    from a count released with noise ``count_stddev`` (sigma_b)."""

    target_quantile: float
    learning_rate: float
    count_stddev: float


class Release(NamedTuple):
    """What one release gives the post-processing step (:class:`~fedprivacy.optim.server_step.ServerStep`)."""

    g: torch.Tensor
    """``g_t``, the noisy average."""
    phi: float
    """Phi_t: the per-coordinate variance of the noise in ``g_t`` (DP-AdamBC, Tang et al., arXiv:2312.14334, §4)."""
    clip_norm: float
    """C_t, the clip it was released at."""
    unclipped_fraction: float | None
    """Under adaptive clipping, the released fraction of unclipped updates; else None."""


def _check_arguments(noise_multiplier: float, clip_norm: float, expected_cohort: int, placement: str) -> None:
    """A clear ``ValueError`` naming the argument, before anything is drawn or accounted."""
    z = noise_multiplier
    if not (math.isfinite(z) and (z == 0.0 or MIN_NOISE_MULTIPLIER <= z <= MAX_NOISE_MULTIPLIER)):
        raise ValueError(f"noise_multiplier must be 0 (no privacy) or in [{MIN_NOISE_MULTIPLIER}, "
                         f"{MAX_NOISE_MULTIPLIER:g}] (what the accountants compute), got {z}")
    if not (math.isfinite(clip_norm) and clip_norm > 0.0):
        raise ValueError(f"clip_norm must be a finite number > 0, got {clip_norm}")
    check_noise_std(z, clip_norm)
    if isinstance(expected_cohort, bool) or int(expected_cohort) != expected_cohort or expected_cohort < 1:
        raise ValueError(f"expected_cohort must be an integer >= 1, got {expected_cohort}")
    if placement not in get_args(Placement):
        raise ValueError(f"placement must be one of {list(get_args(Placement))}, got {placement!r}")


class GaussianMechanism:
    """Clip, sum, ONE Gaussian draw, fixed divisor; the cohort sampler and the ledger that match it.

    Args:
        noise_multiplier: z, the std of the noise on the sum in units of C (0: no privacy).
        clip_norm: C (the initial C under adaptive clipping).
        expected_cohort: m: expected (Poisson) or exact (fixed) cohort, and the fixed divisor.
        population: N, the FULL population the sampler draws from.
        sampling: a schedule's name (:data:`~fedprivacy.privacy.sampling.SCHEDULES`) or a
            :data:`~fedprivacy.privacy.sampling.ScheduleFactory` (module docstring, "Seams").
        placement: who adds the noise (:mod:`.placement`).
        adaptive: adaptive clipping, or None for a fixed C.
        noise_cohort: large-cohort emulation: the claim's cohort M, or None.
        noise_population: large-cohort emulation: the claim's population N', or None.
        seed: None (default): noise and cohort from the OS's cryptographic source; an int: reproducible
            from it (a simulation).
        device: where the sum and the noise live.
        noise_stream: the server's noise across releases (module docstring, "Seams"); a stream other than
            :class:`GaussianNoise` needs ``central`` placement, a fixed clip and no emulation (the clients'
            shares and the adaptive clip's count are independent Gaussians). A stream with ``check_schedule``
            refuses a schedule its accounting does not hold for.
        groups: ``b`` of the cyclic schedules (``cyclic_poisson``, ``min_separated``; :mod:`.sampling`).
    """

    def __init__(self, *, noise_multiplier: float, clip_norm: float, expected_cohort: int, population: int,
                 sampling: Schedule | ScheduleFactory = "poisson", placement: Placement = "central",
                 adaptive: AdaptiveClipping | None = None, noise_cohort: int | None = None,
                 noise_population: int | None = None, seed: int | None = None,
                 device: str | torch.device = "cpu", noise_stream: NoiseStreamFactory = GaussianNoise,
                 groups: int = 1) -> None:
        _check_arguments(noise_multiplier, clip_norm, expected_cohort, placement)
        if noise_stream is not GaussianNoise and (placement != "central" or adaptive is not None):
            raise ValueError(f"noise_stream={stream_name(noise_stream)} needs placement='central' and a fixed clip_norm "
                             f"(got placement={placement!r}, adaptive clipping {'on' if adaptive else 'off'}): client "
                             "shares and the clip count draw independent noise")
        self.noise_stream = noise_stream
        self.noise_multiplier = noise_multiplier
        self.expected_cohort = expected_cohort
        self.population = population
        self.schedule, self.groups = sampling, groups
        self.sampling = part_name(sampling)
        """The schedule's name: as given, or a factory's ``module:qualname``."""
        self.placement = placement
        self.noise_cohort = noise_cohort
        self.claim_population = noise_population or population
        self.seed, self.secure, self.device = seed, seed is None, device
        z_simulated = noise_multiplier * expected_cohort / (noise_cohort or expected_cohort)
        self.value_noise_multiplier = (value_noise_multiplier(z_simulated, adaptive.count_stddev) if adaptive
                                       else z_simulated)
        self.adaptive = (AdaptiveClip(clip_norm, target_quantile=adaptive.target_quantile,
                                      learning_rate=adaptive.learning_rate, count_stddev=adaptive.count_stddev,
                                      expected_cohort=expected_cohort) if adaptive else None)
        self._fixed_clip_norm = clip_norm
        self.ledger = PrivacyLedger()
        self.release_log: ReleaseLog | None = None
        self.epoch = 0
        self._seed_generators()
        if noise_cohort is not None and self.sampler.separation is not None \
                and noise_cohort * groups > self.claim_population:
            raise ValueError(f"privacy.noise_cohort={noise_cohort} times privacy.groups={groups} must be <= the emulated "
                             f"population ({self.claim_population}): each of its groups yields one cohort")
        self._claim_schedule = (None if noise_cohort is None else  # the emulated deployment's schedule: its events only
                                make_sampler(sampling, self.claim_population, noise_cohort, 0, groups=groups))
        check = getattr(self.noise, "check_schedule", None)
        if check is not None:
            check(self.sampler.kind, self.sampler.separation)
        self.event()  # the accountants can compute it (e.g. a sampling rate not below MIN_SAMPLING_RATE)

    # -- what one round draws ----------------------------------------------------------------
    @property
    def clip_norm(self) -> float:
        """This round's C_t."""
        return self.adaptive.clip_norm if self.adaptive else self._fixed_clip_norm

    def _seed_generators(self) -> None:
        seed = 0 if self.seed is None else rekeyed_seed(self.seed, self.epoch)  # ignored when secure
        self.sampler = make_sampler(self.schedule, self.population, self.expected_cohort, seed, secure=self.secure,
                                    groups=self.groups)
        self.noise: NoiseStream = self.noise_stream(seed, device=self.device, secure=self.secure)
        self.stream_starts = [self.next_release]  # a new stream numbers its releases from here

    def sample(self) -> np.ndarray:
        """This round's cohort: sorted indices into ``0..population-1`` (Poisson: possibly empty)."""
        return self.sampler.sample(self.next_release)

    @property
    def next_release(self) -> int:
        """The number of the next release (the ledger holds releases ``1..next_release - 1``)."""
        return self.ledger.rounds + 1

    def event(self) -> AccountedEvent:
        """The accounting event of the next release (:meth:`event_at`)."""
        return self.event_at(self.next_release)

    def event_at(self, release: int) -> AccountedEvent:
        """What release ``release`` is accounted as: the noise stream's event (at the stream's number for it,
        :meth:`stream_release`) for the sampler's (or the emulated deployment's) event with noise multiplier ``z``."""
        schedule = self.sampler if self._claim_schedule is None else self._claim_schedule
        sampled = schedule.round_event(self.noise_multiplier, release)
        return self.noise.event(sampled, self.stream_release(release))

    def could_log(self, release: int, event: AccountedEvent) -> bool:
        """Whether this run could have logged ``event`` for release ``release`` (a resume's check of its release
        log): exactly :meth:`event_at`, numbered by the stream that made it (:meth:`attach_release_log`), unless
        the event depends on who answered (:meth:`release_event`)."""
        return event == self.event_at(release)

    @property
    def stream_start(self) -> int:
        """The release the current noise stream (:attr:`noise`) began at."""
        return self.stream_starts[-1]

    def stream_release(self, release: int) -> int:
        """The noise stream's number for release ``release``: its releases count from 1 since the stream that
        makes it was built, the last of :attr:`stream_starts` not after it (the current one for every release
        still to come; during a resume's check, the streams that made the logged releases)."""
        return release - max(start for start in self.stream_starts if start <= release) + 1

    def release_event(self, agg: PrivateSum) -> AccountedEvent:
        """What the release of ``agg`` is accounted as (seam): the planned :meth:`event`; a mechanism whose noise
        depends on who answered (the clients' shares under secure aggregation) accounts what was added."""
        return self.event()

    def _value_noise_multiplier(self) -> float:
        """The next release's value noise multiplier on the simulated sum: ``z_v f_k``."""
        return self.value_noise_multiplier * self.noise.std_factor(self.stream_release(self.next_release))

    def aggregator(self, dim: int) -> PrivateSum:
        """The round's streaming clip-and-sum at C_t (seam: how updates are clipped and summed)."""
        return PrivateSum(dim, clip_norm=self.clip_norm, noise_multiplier=self._value_noise_multiplier(),
                          expected_cohort=float(self.expected_cohort), device=self.device, placement=self.placement)

    def phi(self) -> float:
        """Per-coordinate noise variance of the next release's ``g_t`` at C_t (DP-AdamBC's Phi_t)."""
        return released_noise_variance(self.placement, self._value_noise_multiplier(), self.clip_norm,
                                       float(self.expected_cohort))

    def prefetch(self, agg: PrivateSum) -> None:
        """Start the release's draw on the noise thread (see :meth:`PrivateSum.prefetch_noise`)."""
        agg.prefetch_noise(self.noise)

    def privatize(self, agg: PrivateSum) -> torch.Tensor:
        """``(sum + noise) / m`` (seam: how the sum is noised and divided)."""
        return agg.release(self.noise)

    def release(self, agg: PrivateSum, round_: int) -> Release:
        """Log the release ahead (if a log is attached), draw the noise, divide, then (adaptive
        clipping) release the clipped count and move C; compose the round's event into the ledger.
        Returns ``g_t`` with the Phi_t and C_t it was released at (:class:`Release`)."""
        event, phi, clip_norm = self.release_event(agg), self.phi(), self.clip_norm
        if self.release_log is not None:
            draw = self.noise.draw_id() if agg.server_noise_std() > 0 else None
            self.release_log.record(self.ledger, round_, event, draw)  # durable BEFORE the noise is added
        g = self.privatize(agg)
        fraction = None
        if self.adaptive:  # its count draw follows the value draw on the same generator (GaussianNoise)
            st = agg.stats
            assert isinstance(self.noise, GaussianNoise)
            fraction = self.adaptive.update_(st.accepted - st.clipped, st.accepted, self.noise,
                                             noise_free=self.noise_multiplier == 0.0)
        self.ledger.compose(event)
        return Release(g, phi, clip_norm, fraction)

    # -- accounting ----------------------------------------------------------------------------
    def epsilons(self, delta: float, kinds: list[AccountantKind]) -> dict[str, float | None]:
        """Epsilon of every release so far under each accountant."""
        return epsilons(self.ledger, delta, kinds)

    def planned_ledger(self, releases: int) -> PrivacyLedger:
        """The ledger after ``releases`` more releases, each accounted as :meth:`event_at` says (calibration)."""
        ledger = PrivacyLedger(self.ledger.entries)
        for release in range(self.next_release, self.next_release + releases):
            ledger.compose(self.event_at(release))
        return ledger

    def budget_accountable(self, kind: AccountantKind) -> tuple[bool, str]:
        """Whether ``kind`` can account this mechanism's releases (its budget check needs it), and what they are."""
        event = self.event()
        return accounts([(event, 1)], kind), type(event).__name__

    def would_exceed(self, delta: float, kind: AccountantKind, target: float) -> bool:
        """Whether the NEXT release would take epsilon above ``target`` (invariant 8: ask before)."""
        return would_exceed(self.ledger, self.event(), delta, kind, target)

    def attach_release_log(self, log: ReleaseLog) -> int:
        """Log every release to ``log``; compose the releases it holds beyond the ledger (a crash after
        them, before a checkpoint) and re-key the generators so that no re-run round reuses a draw or a
        cohort. Returns how many such releases were found.

        The logged releases beyond the ledger were made by the checkpointed stream (numbered from its start, which
        the checkpoint keeps), then by the stream of each resume since, which began a new epoch: each is checked
        as numbered by the stream that made it (:meth:`ReleaseLog.new_epochs_since`). A resume that does not
        continue the checkpointed stream (it found such releases, or the stream's noise came from the OS and
        nothing persisted rebuilds it) begins a new epoch and a fresh stream at the next release, accounted anew
        from its first release (a new horizon).

        Raises:
            ValueError: the log cannot be the record of this run's releases (it holds fewer than the
                ledger, or an event other than the ledger's or this mechanism's; :meth:`ReleaseLog.check`).
        """
        self.stream_starts = [self.stream_starts[0], *log.new_epochs_since(self.ledger)]
        log.check(self.ledger, self.could_log)
        self.release_log = log
        lost = log.lost_since(self.ledger)
        for event in lost:
            self.ledger.compose(event)
        if lost or (self.secure and self.ledger.rounds >= self.stream_starts[0]):
            self.epoch = log.start_epoch(self.epoch)
            self._seed_generators()
        else:
            self.epoch = max(log.epoch, self.epoch)
        return len(lost)

    # -- state ---------------------------------------------------------------------------------
    def state_dict(self) -> dict[str, Any]:
        """The ledger, the epoch, the adaptive clip, the release the noise stream began at (a number: how its
        releases are numbered) and, for a seeded simulation only, the generators' and the noise stream's states
        (from the OS, they are not persisted: nothing written to disk rebuilds a secure draw or cohort, and nothing
        holds noise; a correlated stream then restarts at the resume, accounted anew)."""
        secret = self.secure
        return {"sampler": None if secret else self.sampler.state_dict(),
                "noise": None if secret else self.noise.state_dict(),
                "stream_start": self.stream_start,
                "ledger": self.ledger.state_dict(), "noise_epoch": self.epoch,
                "adaptive_clip": self.adaptive.state_dict() if self.adaptive else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict`; then :meth:`attach_release_log` (a resume) checks and accounts the releases
        logged after it."""
        self.epoch = int(state.get("noise_epoch", 0))
        self.ledger = PrivacyLedger.from_state_dict(state["ledger"])
        checkpointed = int(state.get("stream_start") or self.next_release)  # None: saved before it was kept
        if not self.secure:
            self.sampler.load_state_dict(state["sampler"])
            self.noise.load_state_dict(state["noise"])
            self.stream_starts = [checkpointed]
        else:  # a fresh stream from the OS: its numbering (and a correlated strategy) starts at the next release
            self.stream_starts = [checkpointed, self.next_release]
        if self.adaptive:
            self.adaptive.load_state_dict(state["adaptive_clip"])


def planned_ledger(noise_multiplier: float, releases: int, *, expected_cohort: int, population: int,
                   sampling: Schedule | ScheduleFactory = "poisson", groups: int = 1,
                   noise_stream: NoiseStreamFactory = GaussianNoise, noise_cohort: int | None = None,
                   noise_population: int | None = None) -> PrivacyLedger:
    """The ledger of ``releases`` releases of a fresh central mechanism with these settings (what calibration and
    ``fedprivacy epsilon`` account for cyclic schedules and correlated mechanisms; with ``noise_cohort``, those of
    the emulated deployment)."""
    return GaussianMechanism(noise_multiplier=noise_multiplier, clip_norm=1.0, expected_cohort=expected_cohort,
                             population=population, sampling=sampling, seed=0, noise_stream=noise_stream,
                             groups=groups, noise_cohort=noise_cohort,
                             noise_population=noise_population).planned_ledger(releases)
