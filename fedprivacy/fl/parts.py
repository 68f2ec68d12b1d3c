r"""The parts :class:`~fedprivacy.fl.strategy.DPFedAvg` is built from, one frozen object per question a DP-FedAvg
round answers (McMahan et al. 2018, arXiv:1710.06963, Alg. 1; ARCHITECTURE "One round, in order"):

* :class:`Participation`: who takes part in release ``t``, the schedule over ``N`` users with (expected) cohort
  ``m`` (Poisson, fixed, cyclic, min-separated or one's own :class:`~fedprivacy.privacy.sampling.ParticipationSchedule`);
* :class:`Bounding`: how a contribution is bounded, ``clip(u_i, C_t)`` with fixed or adaptive ``C_t``
  (Andrew et al. 2021, arXiv:1905.03871), and whether the clients also bound their records (record-level DP);
* :class:`Noise`: what noise a release carries, ``N(0, z^2 C_t^2 I)`` drawn by the noise stream, where it is added
  (placement), from which randomness (seed), and as for which deployment (large-cohort emulation);
* the aggregation (:class:`~fedprivacy.fl.aggregation.Aggregation`): how the uploads are summed, plain or secure;
* :class:`ServerStepPart`: what the server does with the private average ``g_t``, the optimizer and DiSK's filter
  (Zhang et al. 2024, arXiv:2410.03883, Alg. 3; :class:`~fedprivacy.optim.server_step.ServerStep`);
* :class:`Accounting`: the delta, the budget that stops the run and the accountants reported.

Each part states what it contributes to the strategy through two methods, so the strategy lists no option itself:
``settings()`` (what a resumed run may not change; the keys and values :attr:`DPFedAvg.settings` always had) and,
for the parts the mechanism is made of, ``mechanism_args()`` (the
:class:`~fedprivacy.privacy.mechanism.GaussianMechanism`'s keyword arguments). :func:`merged` joins them and refuses
a key two parts both claim. Which parts cannot run together is asked in one place
(:func:`~fedprivacy.privacy.combination.refuse_incompatible`). :func:`parts_from_keywords` maps the strategy's
keyword form (``DPFedAvg(noise_multiplier=..., clip_norm=..., ...)``) onto the parts, the one place it is mapped.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Mapping
from dataclasses import asdict, dataclass, field
from typing import Any, TypedDict

from fedprivacy.fl.aggregation import Aggregation, aggregation_of
from fedprivacy.fl.secure_aggregation import SecureAggregation
from fedprivacy.optim.disk import DiskFilter
from fedprivacy.optim.factory import OptimizerName, ServerOptimizer, ServerOptimizerFactory, build_server_optimizer
from fedprivacy.privacy.accounting import AccountantKind
from fedprivacy.privacy.mechanism import AdaptiveClipping, NoiseStreamFactory
from fedprivacy.privacy.noise import GaussianNoise, part_name, stream_name
from fedprivacy.privacy.placement import Placement
from fedprivacy.privacy.sampling import Schedule, ScheduleFactory


@dataclass(frozen=True)
class Participation:
    """Who takes part: ``sampling`` over ``population`` users with ``expected_cohort`` (the fixed divisor ``m``).

    Args:
        expected_cohort: m, the expected (Poisson) or exact (fixed) cohort and the fixed divisor.
        population: N, the number of nodes sampling ranges over (all of them must register).
        sampling: ``"poisson"`` (add/remove-one), ``"fixed"`` (replace-one), the cyclic ``"cyclic_poisson"`` and
            ``"min_separated"`` over ``groups`` groups (:mod:`fedprivacy.privacy.sampling`), or a
            :data:`~fedprivacy.privacy.sampling.ScheduleFactory` of one's own (accounted by its ``round_event``).
        groups: ``b``, the cyclic schedules' number of groups (their min separation).
    """

    expected_cohort: int
    population: int
    sampling: Schedule | ScheduleFactory = "poisson"
    groups: int = 1

    def settings(self) -> dict[str, Any]:
        """``expected_cohort``, ``population``, ``sampling`` (by name) and ``groups`` when not 1."""
        return {"expected_cohort": self.expected_cohort, "population": self.population,
                "sampling": part_name(self.sampling), **({"groups": self.groups} if self.groups != 1 else {})}

    def mechanism_args(self) -> dict[str, Any]:
        return {"expected_cohort": self.expected_cohort, "population": self.population, "sampling": self.sampling,
                "groups": self.groups}


@dataclass(frozen=True)
class Bounding:
    """How each contribution is bounded: the clip ``C`` (the initial ``C_t`` under ``adaptive_clipping``), and
    ``record_level``: the clients train with record-level DP and must report its event with their update.

    Args:
        clip_norm: C.
        adaptive_clipping: Andrew et al.'s quantile clip (arXiv:1905.03871, Alg. 1), or None for a fixed C.
        record_level: a reply without a valid record-level event is rejected as ``unaccounted``.
    """

    clip_norm: float
    adaptive_clipping: AdaptiveClipping | None = None
    record_level: bool = False

    def settings(self) -> dict[str, Any]:
        """``clip_norm``, ``adaptive_clipping`` (as a dict, or None) and ``record_level``."""
        return {"clip_norm": self.clip_norm, "record_level": self.record_level,
                "adaptive_clipping": None if self.adaptive_clipping is None else asdict(self.adaptive_clipping)}

    def mechanism_args(self) -> dict[str, Any]:
        return {"clip_norm": self.clip_norm, "adaptive": self.adaptive_clipping}


@dataclass(frozen=True)
class Noise:
    """What noise each release carries: ``z`` on the sum in units of ``C_t``, drawn by ``stream``, added where
    ``placement`` says, from the randomness ``seed`` names (which also draws the cohorts).

    Args:
        noise_multiplier: z.
        placement: ``central`` (the strategy clips and draws the noise), or ``distributed`` / ``local`` (the
            clients add theirs with :func:`fedprivacy.fl.mods.client_noise_mod`).
        stream: the server's noise across rounds (:class:`~fedprivacy.privacy.noise.NoiseStream`), e.g. a
            :class:`~fedprivacy.privacy.correlated.CorrelatedMechanism`.
        seed: None (a deployment's): cohort and noise from the OS's cryptographic source; an int: a reproducible
            simulation whose cohorts and noise anyone knowing the seed can rebuild.
        noise_cohort: large-cohort emulation (pfl-research's ``noise_cohort_size``): the noise is scaled so the
            epsilon is that of a deployment sampling ``noise_cohort`` of ``noise_population``; it does NOT hold
            for this run (:class:`~fedprivacy.privacy.mechanism.GaussianMechanism`).
        noise_population: the emulated deployment's population (with ``noise_cohort``), or None.
    """

    noise_multiplier: float
    placement: Placement = "central"
    stream: NoiseStreamFactory = GaussianNoise
    seed: int | None = None
    noise_cohort: int | None = None
    noise_population: int | None = None

    def settings(self) -> dict[str, Any]:
        """Every field; the stream by name (``noise_stream``)."""
        return {"noise_multiplier": self.noise_multiplier, "placement": self.placement,
                "noise_stream": stream_name(self.stream), "seed": self.seed, "noise_cohort": self.noise_cohort,
                "noise_population": self.noise_population}

    def mechanism_args(self) -> dict[str, Any]:
        return {"noise_multiplier": self.noise_multiplier, "placement": self.placement, "noise_stream": self.stream,
                "seed": self.seed, "noise_cohort": self.noise_cohort, "noise_population": self.noise_population}


@dataclass(frozen=True)
class ServerStepPart:
    """What the server does with the released ``g_t`` (post-processing): DiSK's filter when ``disk_kappa`` is set,
    then ``optimizer`` (:class:`~fedprivacy.optim.server_step.ServerStep`).

    Args:
        optimizer: ``sgd`` (with ``momentum``, DP-FedAvgM), ``adam``, ``yogi``, ``adagrad``, ``adambc`` (Phi from
            the mechanism), ``microadam``; or a :data:`~fedprivacy.optim.factory.ServerOptimizerFactory` of one's
            own, called as ``optimizer(lr, **optimizer_settings)``.
        lr: the server learning rate.
        optimizer_settings: the optimizer's keyword settings (:func:`fedprivacy.optim.factory.make_server_optimizer`).
        disk_kappa: DiSK's filter gain kappa in (0, 1], or None for no DiSK.
        disk_gamma: DiSK's lookahead step gamma (non-zero).
    """

    optimizer: OptimizerName | ServerOptimizerFactory = "sgd"
    lr: float = 1.0
    optimizer_settings: Mapping[str, Any] = field(default_factory=dict)
    disk_kappa: float | None = None
    disk_gamma: float = 0.5

    def settings(self) -> dict[str, Any]:
        """The optimizer (by name), ``lr``, ``optimizer_settings``, ``disk_kappa`` and ``disk_gamma``."""
        return {"optimizer": part_name(self.optimizer), "lr": self.lr,
                "optimizer_settings": dict(self.optimizer_settings), "disk_kappa": self.disk_kappa,
                "disk_gamma": self.disk_gamma}

    def disk(self) -> DiskFilter | None:
        """DiSK's filter, or None."""
        return None if self.disk_kappa is None else DiskFilter(self.disk_kappa, self.disk_gamma)

    def build_optimizer(self, phi: float) -> ServerOptimizer:
        """The optimizer; ``phi`` is the mechanism's Phi_t (DP-FedAdamBC's default)."""
        return build_server_optimizer(self.optimizer, self.lr, dict(self.optimizer_settings), phi=phi)


@dataclass(frozen=True)
class Accounting:
    """How the releases are accounted and when the run stops.

    Args:
        delta: the target delta in (0, 1) (default ``1 / population``:
            :func:`~fedprivacy.privacy.accounting.resolve_delta`).
        target_epsilon: stop before the round that would exceed it under ``budget_accountant``, or None.
        budget_accountant: the accountant of the budget check (and of the clients' reported epsilons).
        accountants: the epsilons reported each round.
    """

    delta: float | None = None
    target_epsilon: float | None = None
    budget_accountant: AccountantKind = "rdp"
    accountants: tuple[AccountantKind, ...] = ("rdp", "pld")

    def settings(self) -> dict[str, Any]:
        """``delta`` (the budget and the accountants reported may change on a resume)."""
        return {"delta": self.delta}


@dataclass(frozen=True)
class StrategyParts:
    """The strategy's parts, checked for their types (a wrong one is refused naming its parameter)."""

    participation: Participation
    bounding: Bounding
    noise: Noise
    server_step: ServerStepPart
    accounting: Accounting
    aggregation: Aggregation

    def __post_init__(self) -> None:
        for name, cls in (("participation", Participation), ("bounding", Bounding), ("noise", Noise),
                          ("server_step", ServerStepPart), ("accounting", Accounting)):
            if not isinstance(getattr(self, name), cls):
                raise TypeError(f"DPFedAvg: {name} must be a {cls.__name__}, got {type(getattr(self, name)).__name__}")
        if not isinstance(self.aggregation, Aggregation):
            raise TypeError(f"DPFedAvg: aggregation must be an Aggregation (fedprivacy.fl.aggregation), got "
                            f"{type(self.aggregation).__name__}")

    def settings(self) -> dict[str, Any]:
        """What a resumed run may not change: every part's ``settings()``, merged (:func:`merged`)."""
        parts = (self.participation, self.bounding, self.noise, self.server_step, self.accounting, self.aggregation)
        return merged(parts, lambda part: part.settings())

    def mechanism_args(self) -> dict[str, Any]:
        """The mechanism's arguments from the parts it is made of (the strategy adds its ``device``)."""
        return merged((self.participation, self.bounding, self.noise), lambda part: part.mechanism_args())


def merged(parts: Iterable[Any], contribution: Callable[[Any], Mapping[str, Any]]) -> dict[str, Any]:
    """The parts' ``contribution`` joined into one mapping.

    Raises:
        ValueError: two parts give the same key (the later would silently win).
    """
    out: dict[str, Any] = {}
    for part in parts:
        given = contribution(part)
        if taken := sorted(set(given) & set(out)):
            raise ValueError(f"{type(part).__name__} gives {taken[0]!r}, which another part gives too")
        out.update(given)
    return out


class StrategyKeywords(TypedDict, total=False):
    """The keyword form of :class:`~fedprivacy.fl.strategy.DPFedAvg`, typed for its callers (each keyword is read by
    :func:`parts_from_keywords`, which gives the defaults; the first four are required there)."""

    noise_multiplier: float
    clip_norm: float
    expected_cohort: int
    population: int
    sampling: Schedule | ScheduleFactory
    placement: Placement
    optimizer: OptimizerName | ServerOptimizerFactory
    lr: float
    optimizer_settings: Mapping[str, Any] | None
    adaptive_clipping: AdaptiveClipping | None
    disk_kappa: float | None
    disk_gamma: float
    record_level: bool
    delta: float | None
    target_epsilon: float | None
    budget_accountant: AccountantKind
    accountants: tuple[AccountantKind, ...]
    seed: int | None
    noise_cohort: int | None
    noise_population: int | None
    noise_stream: NoiseStreamFactory
    groups: int
    secure_aggregation: SecureAggregation | None


def parts_from_keywords(*, noise_multiplier: float, clip_norm: float, expected_cohort: int, population: int,
                        sampling: Schedule | ScheduleFactory = "poisson", placement: Placement = "central",
                        optimizer: OptimizerName | ServerOptimizerFactory = "sgd", lr: float = 1.0,
                        optimizer_settings: Mapping[str, Any] | None = None,
                        adaptive_clipping: AdaptiveClipping | None = None, disk_kappa: float | None = None,
                        disk_gamma: float = 0.5, record_level: bool = False, delta: float | None = None,
                        target_epsilon: float | None = None, budget_accountant: AccountantKind = "rdp",
                        accountants: tuple[AccountantKind, ...] = ("rdp", "pld"), seed: int | None = None,
                        noise_cohort: int | None = None, noise_population: int | None = None,
                        noise_stream: NoiseStreamFactory = GaussianNoise, groups: int = 1,
                        secure_aggregation: SecureAggregation | None = None,
                        aggregation: Aggregation | None = None) -> StrategyParts:
    """The keyword form of :class:`~fedprivacy.fl.strategy.DPFedAvg` as its parts (each keyword is the field of
    the same name, ``noise_stream`` is :attr:`Noise.stream`, ``secure_aggregation`` is
    ``aggregation=SecureAggregationPart(secure_aggregation)``)."""
    return StrategyParts(
        participation=Participation(expected_cohort, population, sampling, groups),
        bounding=Bounding(clip_norm, adaptive_clipping, record_level),
        noise=Noise(noise_multiplier, placement, noise_stream, seed, noise_cohort, noise_population),
        server_step=ServerStepPart(optimizer, lr, dict(optimizer_settings or {}), disk_kappa, disk_gamma),
        accounting=Accounting(delta, target_epsilon, budget_accountant, tuple(accountants)),
        aggregation=aggregation_of(aggregation, secure_aggregation))


def strategy_parts(participation: Participation | None, bounding: Bounding | None, noise: Noise | None,
                   server_step: ServerStepPart | None, accounting: Accounting | None, aggregation: Aggregation | None,
                   keywords: Mapping[str, Any]) -> StrategyParts:
    """The parts :class:`~fedprivacy.fl.strategy.DPFedAvg` was given: the objects (``server_step``, ``accounting`` and
    ``aggregation`` default to SGD at lr 1, delta ``1 / population`` and the plain sum), or the keyword form
    (:func:`parts_from_keywords`), never both.

    Raises:
        TypeError: both forms, a missing part or keyword, an unknown keyword, or a part of the wrong type, named.
    """
    given = {"participation": participation, "bounding": bounding, "noise": noise, "server_step": server_step,
             "accounting": accounting}
    if keywords:
        if named := [name for name, part in given.items() if part is not None]:
            raise TypeError(f"DPFedAvg: give the parts ({named[0]}=...) or the keyword form "
                            f"({next(iter(keywords))}=...), not both")
        return parts_from_keywords(aggregation=aggregation, **keywords)
    if missing := [name for name in ("participation", "bounding", "noise") if given[name] is None]:
        raise TypeError(f"DPFedAvg: missing {missing[0]}= (or the keyword form: noise_multiplier=..., clip_norm=..., "
                        "expected_cohort=..., population=...)")
    return StrategyParts(participation, bounding, noise, server_step or ServerStepPart(),  # type: ignore[arg-type]
                         accounting or Accounting(), aggregation_of(aggregation, None))
