"""Accounted events: what the privacy ledger composes, the release log records and checkpoints hold.

An accounted event is a frozen dataclass describing one release, which says what it is in dp-accounting's
terms (:meth:`AccountedEvent.dp_event`, a ``dp_accounting.DpEvent``) and under which neighbouring relation.
fedprivacy's own is :class:`~fedprivacy.privacy.accounting.GaussianRound` (a subsampled Gaussian); a new
mechanism brings its own event type and registers it (:func:`register_event`): the ledger, the release log
and the checkpoints then carry it, and the accountants compose its ``DpEvent``
(:func:`~fedprivacy.privacy.accounting.epsilon`).

Serialization is here and only here: ``{"type": <registered name>, <field>: <value>, ...}``
(:func:`event_to_dict`, :func:`event_from_dict`). Reading goes through the registry, an allow-list: a file
cannot name code to run, and a record with unknown or missing fields is an error naming them.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Mapping
from typing import Any, Protocol, TypeVar

import dp_accounting


class AccountedEvent(Protocol):
    """One release as the ledger composes it (a frozen, comparable dataclass; module docstring).

    To implement one: a frozen dataclass whose fields are JSON-able numbers and strings (they are written as
    ``{"type": <class name>, <field>: <value>, ...}``), with :attr:`neighboring_relation` and :meth:`dp_event`,
    decorated with :func:`register_event`; its ``__post_init__`` checks the fields (raising ValueError naming
    the field: a release log or checkpoint read back is untrusted input). The accountants compose
    :meth:`dp_event` (rdp: dp-accounting's ``RdpAccountant``; pld: its ``PLDAccountant``; prv: None), or an
    RDP curve the event states itself, ``rdp(orders) -> sequence of floats`` (rdp only; e.g.
    :class:`~fedprivacy.privacy.skellam_accounting.SkellamRound`). ``tests/engine/test_custom_noise_stream.py``'s
    ``AlternatingRound``, a Poisson-subsampled Gaussian with its own noise multiplier per release, is one."""

    @property
    def neighboring_relation(self) -> dp_accounting.NeighboringRelation:
        """The neighbouring relation its guarantee is stated under (a ledger composes only one)."""

    def dp_event(self) -> dp_accounting.DpEvent:
        """The release as a dp-accounting event."""

    def __hash__(self) -> int: ...


_EVENT_TYPES: dict[str, type] = {}
E = TypeVar("E", bound=type)


def register_event(cls: E) -> E:
    """Allow ``cls`` (a frozen dataclass implementing :class:`AccountedEvent`) in ledgers, release logs and
    checkpoints, under its class name; usable as a class decorator.

    Raises:
        TypeError: ``cls`` is not a frozen dataclass, or another class is registered under its name.
    """
    if not (dataclasses.is_dataclass(cls) and cls.__dataclass_params__.frozen):  # type: ignore[attr-defined]
        raise TypeError(f"an accounted event must be a frozen dataclass, got {cls!r}")
    if _EVENT_TYPES.setdefault(cls.__name__, cls) is not cls:
        raise TypeError(f"another event type is registered as {cls.__name__!r}")
    return cls


def is_registered(event: object) -> bool:
    """Whether ``event`` is an instance of a registered event type."""
    return _EVENT_TYPES.get(type(event).__name__) is type(event)


def event_to_dict(event: AccountedEvent) -> dict[str, Any]:
    """``{"type": <name>, **fields}``: JSON-able when the fields are (they are, for every event fedprivacy has).

    Raises:
        TypeError: ``event``'s type is not registered.
    """
    if not is_registered(event):
        raise TypeError(f"{type(event).__name__} is not a registered accounted event (register_event)")
    return {"type": type(event).__name__, **dataclasses.asdict(event)}  # type: ignore[call-overload]


def event_from_dict(item: Mapping[str, Any]) -> AccountedEvent:
    """The event :func:`event_to_dict` wrote, through the registry; its own checks apply to the fields.

    Raises:
        ValueError: not a mapping, an unknown ``type``, missing or unexpected fields, or fields the event
            type refuses (its message names them).
    """
    kind = item.get("type") if isinstance(item, Mapping) else None
    if not isinstance(kind, str) or kind not in _EVENT_TYPES:
        raise ValueError(f"unknown event type {kind!r}; allowed: {sorted(_EVENT_TYPES)}")
    cls = _EVENT_TYPES[kind]
    names = {f.name for f in dataclasses.fields(cls)}
    given = set(item) - {"type"}
    if given != names:
        raise ValueError(f"event {kind}: expected fields {sorted(names)}, got {sorted(given)}")
    try:
        return cls(**{n: item[n] for n in names})
    except TypeError as err:
        raise ValueError(f"event {kind}: {err}") from None
