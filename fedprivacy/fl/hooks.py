"""What :meth:`DPFedAvg.start <fedprivacy.fl.strategy.DPFedAvg.start>`'s loop calls around its rounds: a
:class:`RunHook` at each named point, in the order the hooks are given. ``fedprivacy run`` is the strategy plus
its hooks (:mod:`fedprivacy.fl.run_hooks`); a hand-written ServerApp passes its own, or none.

The loop, for ``t = round + 1 .. num_rounds`` (:meth:`~fedprivacy.fl.strategy.DPFedAvg.start`)::

    start(strategy, grid) -> grid     once, after the state (if any) is loaded and the strategy resumed
    before_round(t)                   before the cohort is sampled
    sampled(t, cohort)                the cohort is sampled, its messages built, nothing sent yet
    after_round(t, metrics)           the release made and post-processed, the evaluation (``evaluate_fn``) done:
                                      the round's metrics, a hook may add its own for the hooks after it
    state_dict() / checkpointed()     at a checkpoint (every ``checkpoint_every`` rounds, at a stop, at the end):
                                      the hook's state saved with the strategy's, then told it is on disk
    stop_requested()                  after each round: any True checkpoints and ends the run (RunStopped)

A resume hands every hook the saved state (``load_state_dict``, before ``start``) and refuses a change of any
hook's ``fixed_settings`` as of the strategy's own settings (:class:`~fedprivacy.fl.strategy_state.StrategyState`).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

from flwr.serverapp import Grid

from fedprivacy.stopping import stop_requested

if TYPE_CHECKING:
    from fedprivacy.fl.strategy import DPFedAvg


class RunHook:
    """A part of a run around the strategy's rounds (module docstring); each point does nothing by default."""

    def fixed_settings(self) -> dict[str, Any]:
        """Settings a resume may not change (saved with the state, compared by name)."""
        return {}

    def former_settings(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """The ``fixed_settings`` a state written before settings were saved (no version) was run with, as far as
        ``state`` tells; None: this hook cannot tell (its current ones are taken)."""
        return None

    def state_dict(self) -> dict[str, Any]:
        """The hook's state, saved in the checkpoint beside the strategy's (its keys must not clash with them)."""
        return {}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Restore from a checkpoint (the whole saved state: the strategy's keys and every hook's)."""

    def start(self, strategy: DPFedAvg, grid: Grid) -> Grid:
        """The run begins or resumes at ``strategy.round``; returns the grid the rounds use (possibly wrapped)."""
        return grid

    def before_round(self, t: int) -> None:
        """Round ``t`` is about to sample its cohort."""

    def sampled(self, t: int, cohort: Sequence[int]) -> None:
        """Round ``t``'s cohort is sampled and its messages built."""

    def after_round(self, t: int, metrics: dict[str, float]) -> None:
        """Round ``t`` is done; ``metrics`` (the strategy's and the evaluation's) may be added to."""

    def checkpointed(self) -> None:
        """The state, this hook's included, is on disk."""

    def stop_requested(self) -> bool:
        """Whether the run should stop after this round (with a checkpoint)."""
        return False


class StopOnRequest(RunHook):
    """The graceful stop (:mod:`fedprivacy.stopping`): SIGTERM, or :func:`~fedprivacy.stopping.request_stop`,
    ends the run after its current round, checkpointed, so that a resume loses nothing."""

    def stop_requested(self) -> bool:
        return stop_requested()
