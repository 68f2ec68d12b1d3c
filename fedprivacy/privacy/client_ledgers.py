r"""Per-client privacy ledgers: guarantees that belong to ONE client, not to the released model.

Two mechanisms run on the client and protect it whatever the server does: local noise (each upload
is a Gaussian mechanism of its own, :func:`fedprivacy.privacy.placement.local_epsilon`) and
sample-level DP training (each local DP-SGD step is a Poisson-subsampled Gaussian over the client's
own examples). Each client's releases are composed only over the rounds it took part in, in a
:class:`~fedprivacy.privacy.accounting.PrivacyLedger` of its own, and reported separately from the
run's user-level epsilon (ARCHITECTURE, "Noise placements").

Composition is order-free, so clients whose ledgers hold the same multiset of events (and the same
delta) share one epsilon computation (with k participations of one event type there are at most k
distinct values). Each client's epsilon is at the run's delta unless the client has its own (record-
level DP: by default 0.1 / n_i, n_i its privacy units; :func:`fedprivacy.client.sample_dp.client_delta`),
recorded with :meth:`ClientLedgers.compose`.

A delta of at least 1 / n, n the client's privacy units (the population of its events), is flagged
(:meth:`ClientLedgers.weak_delta`: a ``weak_delta`` column, a count in the summary, a warning) but
still reported: the mechanism that publishes each unit with probability delta is (0, delta)-DP and
would publish one of the client's units in expectation (Dwork & Roth 2014, §2.3). Epsilons are
those of :func:`~fedprivacy.privacy.accounting.epsilon` (>= 0, ``inf`` without noise); the
summary writes ``inf`` as ``"inf"`` (:func:`~fedprivacy.privacy.accounting.json_epsilon`), the CSV as ``inf``.
"""

from __future__ import annotations

import csv
import logging
import math
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

from fedprivacy.privacy.accounting import AccountantKind, GaussianRound, PrivacyLedger, epsilon, json_epsilon
from fedprivacy.privacy.bounds import MAX_NOISE_MULTIPLIER, MIN_DELTA, MIN_NOISE_MULTIPLIER
from fedprivacy.privacy.placement import local_upload_event

log = logging.getLogger(__name__)


METRIC_PREFIX = "sample-dp-"
MAX_STEPS_PER_ROUND = 10**5
"""More local DP steps than this in one round is not a real client's report (and would stall PRV/PLD)."""
MIN_CLIENT_SAMPLING_RATE = 1e-4
"""A client's reported rate q = B / n is accounted as at least this (B = 1 of n = 10,000 records), which
only raises its epsilon: the PLD grid is fine where q is small (6 s at q = 1e-6, z = 0.3, one step).
With q >= this and steps <= :data:`MAX_STEPS_PER_ROUND`, one client's event costs at most 1.3 s (pld)
and 6.4 s (prv) to account (measured over z in [0.1, 100], q in [1e-4, 1], 1e5 steps; above
``EPSILON_CEILING`` neither is computed)."""
MAX_POPULATION = 2**53
"""More privacy units than this is not a real client's report (and not exact as a float)."""


def event_metrics(result: Any) -> dict[str, float]:
    """A sample-level DP client's reply metrics describing its round's releases: ``result.steps`` x
    ``result.event`` = ``GaussianRound(z, poisson, n, B)``, at the client's own ``result.target_delta``.

    ``population`` n and ``expected-batch`` B are in privacy units (``q = B / n``); ``epsilon`` is this
    participation's epsilon (diagnostic).
    """
    e = result.event
    return {f"{METRIC_PREFIX}noise-multiplier": e.noise_multiplier, f"{METRIC_PREFIX}population": e.population,
            f"{METRIC_PREFIX}expected-batch": e.expected_cohort, f"{METRIC_PREFIX}q": e.q,
            f"{METRIC_PREFIX}steps": result.steps, f"{METRIC_PREFIX}delta": result.target_delta,
            f"{METRIC_PREFIX}epsilon": result.epsilon}


def event_from_metrics(metrics: Any) -> tuple[GaussianRound, int, float]:
    """Inverse of :func:`event_metrics`, for untrusted replies: ``(event, steps, delta)``, always within
    what the accountants compute (:mod:`~fedprivacy.privacy.accounting`, "Accountable range").

    A reported value outside that range is moved to the side that can only raise the client's epsilon,
    never lower it: z below ``MIN_NOISE_MULTIPLIER`` is accounted as z = 0 (no privacy: epsilon ``inf``),
    z above ``MAX_NOISE_MULTIPLIER`` as that maximum, a non-zero rate q = B / n below
    :data:`MIN_CLIENT_SAMPLING_RATE` as that minimum (epsilon grows with q and falls with z).

    Raises:
        ValueError: a field is missing, of the wrong type, non-finite or out of range (``steps`` an
            integer in ``[1, MAX_STEPS_PER_ROUND]``, ``delta`` in ``[MIN_DELTA, 1)``, ``population`` an integer
            in ``[1, MAX_POPULATION]``, ``expected-batch`` in ``[0, population]``, z >= 0).
    """
    try:
        values = {name: metrics[f"{METRIC_PREFIX}{name}"]
                  for name in ("noise-multiplier", "population", "expected-batch", "steps", "delta")}
    except (KeyError, TypeError) as err:
        raise ValueError(f"missing {err}") from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) for v in values.values()):
        raise ValueError(f"non-numeric or non-finite event fields {values}")
    z, population, batch = float(values["noise-multiplier"]), values["population"], float(values["expected-batch"])
    steps, delta = values["steps"], float(values["delta"])
    if not (float(steps).is_integer() and 1 <= steps <= MAX_STEPS_PER_ROUND):
        raise ValueError(f"steps must be an integer in [1, {MAX_STEPS_PER_ROUND}], got {steps}")
    if not MIN_DELTA <= delta < 1.0:
        raise ValueError(f"delta must be in [{MIN_DELTA:g}, 1), got {delta}")
    if not (float(population).is_integer() and 1 <= population <= MAX_POPULATION):
        raise ValueError(f"population must be an integer in [1, {MAX_POPULATION}], got {population}")
    if not (z >= 0.0 and 0.0 <= batch <= population):
        raise ValueError(f"noise-multiplier must be >= 0 and expected-batch in [0, population={population}], "
                         f"got {z} and {batch}")
    z = 0.0 if z < MIN_NOISE_MULTIPLIER else min(z, MAX_NOISE_MULTIPLIER)
    batch = min(max(batch, MIN_CLIENT_SAMPLING_RATE * population), population) if batch > 0 else 0.0
    return GaussianRound(z, "poisson", int(population), batch), int(steps), delta


class ClientLedgers:
    """``partition id -> PrivacyLedger`` of the client-side releases of each client (and its own delta, if any)."""

    def __init__(self) -> None:
        self._ledgers: dict[int, PrivacyLedger] = {}
        self._deltas: dict[int, float] = {}

    def compose(self, client: int, event: GaussianRound, count: int = 1, delta: float | None = None) -> None:
        """Add ``count`` releases of ``event`` to ``client``'s ledger; ``delta``: the client's own delta from now on."""
        self._ledgers.setdefault(client, PrivacyLedger()).compose(event, count)
        if delta is not None:
            self._deltas[client] = delta

    def compose_reply(self, client: int, metrics: Any, *, record_level: bool,
                      local_noise_multiplier: float | None = None) -> None:
        """Compose the client-side releases one reply accounts for into ``client``'s ledger.

        ``metrics``: the reply's (untrusted) metrics. With ``record_level`` (the run asked for client-
        reported record-level DP), its sample-level DP event (:func:`event_from_metrics`: ``steps`` x
        ``GaussianRound(z, poisson, n, B)`` at the client's own delta) is composed, and a missing or
        invalid one raises ``ValueError`` naming the bad field (the caller rejects the reply as
        unaccounted) before anything is released. Without it, the metrics are not read at all: nothing a
        client reports unasked enters an accountant. A client's reported epsilon is never used: epsilons
        are recomputed from the events. ``local_noise_multiplier``: under local placement the upload
        itself is a Gaussian release (:func:`~.placement.local_upload_event`).
        """
        if record_level:
            try:
                event, steps, delta = event_from_metrics(metrics)
            except ValueError as err:
                raise ValueError(f"no valid sample-DP event ({err})") from None
            self.compose(client, event, steps, delta=delta)
        if local_noise_multiplier is not None:
            self.compose(client, local_upload_event(local_noise_multiplier))

    def delta(self, client: int, default: float) -> float:
        """The delta of ``client``'s epsilon: its own, else ``default`` (the run's)."""
        return self._deltas.get(client, default)

    def weak_delta(self, client: int, default: float) -> bool:
        """Whether ``client``'s delta is at least 1 / n, n its privacy units (its events' largest population)."""
        units = max(event.population for event, _ in self._ledgers[client].entries if isinstance(event, GaussianRound))
        return self.delta(client, default) >= 1 / units

    def __len__(self) -> int:
        return len(self._ledgers)

    def epsilons(self, delta: float, kind: AccountantKind) -> dict[int, float]:
        """Each client's epsilon at its own delta, else ``delta`` (once per distinct multiset of events and delta)."""
        memo: dict[tuple[frozenset, float], float] = {}
        out = {}
        for client, ledger in self._ledgers.items():
            client_delta = self.delta(client, delta)
            key = (frozenset(_multiset(ledger).items()), client_delta)
            if key not in memo:
                eps = epsilon(ledger, client_delta, kind)
                assert eps is not None, "client events are Poisson-sampled: every accountant computes them"
                memo[key] = eps
            out[client] = memo[key]
        return out

    def summary(self, delta: float, kind: AccountantKind) -> dict[str, float | str | None]:
        """Max and median client epsilon (``"inf"`` if infinite), how many clients have one, how many a weak delta."""
        eps = list(self.epsilons(delta, kind).values())
        if not eps:
            return {"client_epsilon_clients": 0.0}
        return {"client_epsilon_clients": float(len(eps)), "client_epsilon_max": json_epsilon(max(eps)),
                "client_epsilon_median": json_epsilon(float(statistics.median(eps))),
                "client_weak_delta_clients": float(sum(self.weak_delta(c, delta) for c in self._ledgers))}

    def write_csv(self, path: Path, delta: float, kinds: list[AccountantKind]) -> None:
        """One row per client: id, releases composed, the delta, whether it is weak, epsilon under each accountant."""
        per_kind = {k: self.epsilons(delta, k) for k in kinds}
        rows = [{"client": c, "releases": ledger.rounds, "delta": self.delta(c, delta),
                 "weak_delta": self.weak_delta(c, delta), **{f"epsilon_{k}": per_kind[k][c] for k in kinds}}
                for c, ledger in sorted(self._ledgers.items())]
        weak = [int(row["client"]) for row in rows if row["weak_delta"]]
        if weak:
            log.warning("%d client(s) have delta >= 1 / (their privacy units), a weak guarantee (weak_delta in %s); "
                        "first: %s", len(weak), path.name, weak[:10])
        with open(path, "w", newline="") as f:
            writer = csv.DictWriter(f, ["client", "releases", "delta", "weak_delta", *(f"epsilon_{k}" for k in kinds)])
            writer.writeheader()
            writer.writerows(rows)

    def state_dict(self) -> dict[str, Any]:
        return {"ledgers": {str(c): ledger.state_dict() for c, ledger in self._ledgers.items()},
                "deltas": {str(c): d for c, d in self._deltas.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore :meth:`state_dict` output (or the older ``{client: ledger}`` form, without deltas)."""
        ledgers, deltas = (state["ledgers"], state["deltas"]) if "ledgers" in state else (state, {})
        self._ledgers = {int(c): PrivacyLedger.from_state_dict(s) for c, s in ledgers.items()}
        self._deltas = {int(c): float(d) for c, d in deltas.items()}


def _multiset(ledger: PrivacyLedger) -> Counter:
    counts: Counter = Counter()
    for event, count in ledger.entries:
        counts[event] += count
    return counts
