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

import logging
import statistics
from collections import Counter
from pathlib import Path
from typing import Any

import pandas as pd

from fedprivacy.privacy.accounting import AccountantKind, GaussianRound, PrivacyLedger, epsilon, json_epsilon
from fedprivacy.privacy.placement import local_upload_event

log = logging.getLogger(__name__)


METRIC_PREFIX = "sample-dp-"
MAX_STEPS_PER_ROUND = 10**6
"""More local DP steps than this in one round is not a real client's report (and would stall the PLD)."""


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
    """Inverse of :func:`event_metrics`, for untrusted replies: ``(event, steps, delta)``.

    Raises:
        ValueError: a field is missing, of the wrong type, non-finite or out of range (``steps`` an
            integer in ``[1, MAX_STEPS_PER_ROUND]``, ``delta`` in ``(0, 1)``, the event's own checks).
    """
    try:
        values = {name: metrics[f"{METRIC_PREFIX}{name}"]
                  for name in ("noise-multiplier", "population", "expected-batch", "steps", "delta")}
    except (KeyError, TypeError) as err:
        raise ValueError(f"missing {err}") from None
    if not all(isinstance(v, (int, float)) and not isinstance(v, bool) for v in values.values()):
        raise ValueError(f"non-numeric event fields {values}")
    steps, delta, population = values["steps"], float(values["delta"]), values["population"]
    if not (float(steps).is_integer() and 1 <= steps <= MAX_STEPS_PER_ROUND):
        raise ValueError(f"steps must be an integer in [1, {MAX_STEPS_PER_ROUND}], got {steps}")
    if not 0.0 < delta < 1.0:
        raise ValueError(f"delta must be in (0, 1), got {delta}")
    if not (float(population).is_integer() and population >= 1):
        raise ValueError(f"population must be a positive integer, got {population}")
    event = GaussianRound(float(values["noise-multiplier"]), "poisson", int(population),
                          float(values["expected-batch"]))
    return event, int(steps), delta


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
                      local_noise_multiplier: float | None = None) -> bool:
        """Compose the client-side releases one reply accounts for into ``client``'s ledger; whether a
        sample-level DP event was composed.

        ``metrics``: the reply's (untrusted) metrics. Its sample-level DP event (:func:`event_from_metrics`:
        ``steps`` x ``GaussianRound(z, poisson, n, B)`` at the client's own delta) is composed when valid.
        With ``record_level`` (the run requires record-level DP), a missing or invalid event raises
        ``ValueError`` naming the bad field (the caller rejects the reply as unaccounted); without it, such
        an event is ignored (a client that claims nothing valid is accounted nothing). A client's reported
        epsilon is never used: epsilons are recomputed from the events. ``local_noise_multiplier``: under
        local placement the upload itself is a Gaussian release (:func:`~.placement.local_upload_event`).
        """
        try:
            event, steps, delta = event_from_metrics(metrics)
        except ValueError as err:
            if record_level:
                raise ValueError(f"no valid sample-DP event ({err})") from None
            event = None
        if event is not None:
            self.compose(client, event, steps, delta=delta)
        if local_noise_multiplier is not None:
            self.compose(client, local_upload_event(local_noise_multiplier))
        return event is not None

    def delta(self, client: int, default: float) -> float:
        """The delta of ``client``'s epsilon: its own, else ``default`` (the run's)."""
        return self._deltas.get(client, default)

    def weak_delta(self, client: int, default: float) -> bool:
        """Whether ``client``'s delta is at least 1 / n, n its privacy units (its events' largest population)."""
        units = max(event.population for event, _ in self._ledgers[client].entries)
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
                memo[key] = float(epsilon(ledger, client_delta, kind))
            out[client] = memo[key]
        return out

    def summary(self, delta: float, kind: AccountantKind) -> dict[str, float | str]:
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
        pd.DataFrame(rows).to_csv(path, index=False)

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
