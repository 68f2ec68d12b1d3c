"""``fedprivacy run``'s parts around the strategy's rounds, each a :class:`~fedprivacy.fl.hooks.RunHook` that
:meth:`DPFedAvg.start <fedprivacy.fl.strategy.DPFedAvg.start>`'s loop calls at its named points
(:class:`~fedprivacy.fl.server_app.DPFedAvgServer` builds them from the config):

- :class:`RunRecords`: ``metrics.csv`` (a row per round: the strategy's metrics, the evaluation, the AdaDPS bytes,
  the round's wall time), the round's log line, the caller's ``on_round``; its state: the rows and the config, whose
  :data:`~fedprivacy.outputs.FIXED_ON_RESUME` fields a resume may not change;
- :class:`Evaluation`: the ``evaluate_fn`` of Flower's loop, at every ``eval_every``-th round and the last (never at
  the round a start begins from: that model was evaluated, or not, when its round ran);
- :class:`SideInformationRefresh`: AdaDPS's public ``A`` rebuilt at the released ``x_t`` when due, its bytes per round;
- :class:`Canaries`: the canary clients' grid wrapper and their seed;
- :class:`NodeStates`: the in-process nodes' own states (compression residuals, AdaDPS's ``A``) across a resume;
- :class:`Population`: the users in partition order (:func:`~fedprivacy.fl.population.discover_nodes`);
- :class:`Tracking`: TensorBoard and MLflow get each row once it is checkpointed (so a resume has nothing to take
  back).

The graceful stop is :class:`~fedprivacy.fl.hooks.StopOnRequest`.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import torch
from flwr.app import ArrayRecord, MetricRecord
from flwr.serverapp import Grid
from torch.nn.utils import vector_to_parameters

from fedprivacy.config import ConfigError, RunConfig
from fedprivacy.fl.canaries import RunCanaries
from fedprivacy.fl.hooks import RunHook
from fedprivacy.fl.population import discover_nodes
from fedprivacy.fl.side_information import SideInformationBroadcast
from fedprivacy.callbacks import RoundCallback
from fedprivacy.outputs import RunOutputs, fixed_settings
from fedprivacy.task import Task
from fedprivacy.tracking import RunTracker

if TYPE_CHECKING:
    from fedprivacy.fl.strategy import DPFedAvg

log = logging.getLogger("fedprivacy.fl.server_app")  # the run's lines, under the run's logger as ever


def _params(strategy: DPFedAvg | None) -> torch.Tensor:
    assert strategy is not None and strategy.params is not None, "the hook runs inside the strategy's start()"
    return strategy.params


class SideInformationRefresh(RunHook):
    """AdaDPS (Li et al. 2022, arXiv:2202.05963v2, Alg. 3): the public ``A`` rebuilt at the released ``x_t`` when its schedule
    says so, before the round samples (:class:`~fedprivacy.fl.side_information.SideInformationBroadcast`)."""

    def __init__(self, side_info: SideInformationBroadcast, model: torch.nn.Module, outputs: RunOutputs) -> None:
        self.side_info, self.model, self.outputs = side_info, model, outputs
        self.strategy: DPFedAvg | None = None
        self.sent = 0  # bytes of A in this round's messages

    def state_dict(self) -> dict[str, Any]:
        return {"side_information": self.side_info.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.side_info.load_state_dict(state["side_information"])

    def start(self, strategy: DPFedAvg, grid: Grid) -> Grid:
        self.strategy = strategy
        return grid

    def before_round(self, t: int) -> None:
        vector_to_parameters(_params(self.strategy), self.model.parameters())
        assert self.strategy is not None
        if self.side_info.update(self.strategy.round, self.model):
            self.outputs.write_json("side_information.json", self.side_info.builds)

    def sampled(self, t: int, cohort: Sequence[int]) -> None:
        self.sent = sum(self.side_info.bytes_for(node) for node in cohort)  # before the replies mark the holders


class RunRecords(RunHook):
    """``metrics.csv``, the round's log line and ``on_round`` (module docstring). A row holds ``round``,
    ``train_loss``, ``test_loss`` and ``test_accuracy`` (NaN when not measured), the round's metrics, AdaDPS's
    ``side_information_bytes`` and ``seconds``, the round's wall time from before the side information refresh to
    after the evaluation."""

    def __init__(self, cfg: RunConfig, outputs: RunOutputs, on_round: RoundCallback | None,
                 side_info: SideInformationRefresh | None) -> None:
        self.cfg, self.outputs, self.on_round, self.side_info = cfg, outputs, on_round, side_info
        self._config = cfg.to_json()
        self._fixed = fixed_settings(json.loads(self._config))
        self._t0 = 0.0

    def fixed_settings(self) -> dict[str, Any]:
        return dict(self._fixed)

    def former_settings(self, state: Mapping[str, Any]) -> dict[str, Any] | None:
        """A checkpoint of the former run loop holds the config it ran with (``config``, its JSON)."""
        config = state.get("config")
        return fixed_settings(json.loads(config)) if isinstance(config, str) else None

    def state_dict(self) -> dict[str, Any]:
        return {"metrics": self.outputs.rows, "config": self._config}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.outputs.restore(state["metrics"])

    def before_round(self, t: int) -> None:
        self._t0 = time.perf_counter()

    def after_round(self, t: int, metrics: dict[str, float]) -> None:
        row: dict[str, float] = {"round": t, "train_loss": float("nan"), "test_loss": float("nan"),
                                 "test_accuracy": float("nan"), **metrics}
        if self.side_info is not None:
            row["side_information_bytes"] = float(self.side_info.sent)
        row["seconds"] = time.perf_counter() - self._t0
        self.outputs.log_round(row)
        accountant = self.cfg.privacy.budget_accountant
        accuracy = row.get("test_accuracy", float("nan"))
        log.info("round %d: cohort %d, eps(%s) %.4g, %.2fs%s", t, int(row["cohort_sampled"]), accountant,
                 row[f"epsilon_{accountant}"], row["seconds"],
                 f", test accuracy {accuracy:.4f}" if accuracy == accuracy else "")
        if self.on_round is not None:
            self.on_round(t, row)


class Evaluation(RunHook):
    """The task's evaluation of the released model at round ``t`` when ``t % eval_every == 0`` or ``t`` is the last
    round; Flower's ``evaluate_fn`` (called as ``evaluation(t, arrays)``)."""

    def __init__(self, cfg: RunConfig, task: Task, model: torch.nn.Module) -> None:
        self.cfg, self.task, self.model = cfg, task, model
        self.strategy: DPFedAvg | None = None
        self.first = 0  # the round this start began from: its model is not evaluated again

    def start(self, strategy: DPFedAvg, grid: Grid) -> Grid:
        self.strategy, self.first = strategy, strategy.round
        return grid

    def __call__(self, t: int, arrays: ArrayRecord) -> MetricRecord | None:
        if t <= self.first or not (t % self.cfg.eval_every == 0 or t == self.cfg.rounds):
            return None
        vector_to_parameters(_params(self.strategy), self.model.parameters())
        return MetricRecord({k: float(v) for k, v in self.task.evaluate(self.model).items()})


class Canaries(RunHook):
    """The canary clients (:mod:`fedprivacy.fl.canaries`): members of the population from round 1, answered by the
    grid wrapper; their seed is the run's (a resume keeps it)."""

    def __init__(self, canaries: RunCanaries) -> None:
        self.canaries = canaries
        self.strategy: DPFedAvg | None = None

    def state_dict(self) -> dict[str, Any]:
        return {"canaries": self.canaries.state_dict()}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        if state.get("canaries") is None:
            raise ConfigError("privacy.canaries is set but the checkpoint holds no canaries (the run started "
                              "without them): a run's canaries are part of its population from round 1")
        self.canaries.load_state_dict(state["canaries"])

    def start(self, strategy: DPFedAvg, grid: Grid) -> Grid:
        """After the resume (the canaries' seed and every-round statistic are the checkpoint's): the grid wrapper, and
        the model the next round's change is taken from."""
        self.strategy = strategy
        if self.canaries.cfg.every_round:
            self.canaries.start(_params(strategy))
        return self.canaries.grid(grid)

    def after_round(self, t: int, metrics: dict[str, float]) -> None:
        """The every-round statistic (``privacy.canaries.every_round``), before the round's checkpoint."""
        if self.canaries.cfg.every_round:
            self.canaries.observe(_params(self.strategy))


class NodeStates(RunHook):
    """The nodes' own states where the engine holds them (in-process: ``node_state_dict``); real SuperNodes keep
    theirs. Without them a resume restarts the uplink residuals at zero (logged)."""

    def __init__(self, compression: bool) -> None:
        self.compression = compression
        self.grid: Grid | None = None
        self.saved: Mapping[str, Any] | None = None

    def state_dict(self) -> dict[str, Any]:
        states = getattr(self.grid, "node_state_dict", None)  # in-process grids hold them
        return {"node_states": states() if states is not None else None}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        self.saved = state

    def start(self, strategy: DPFedAvg, grid: Grid) -> Grid:
        self.grid = grid
        if self.saved is None:
            return grid
        if self.saved.get("node_states") and hasattr(grid, "load_node_state_dict"):
            grid.load_node_state_dict(self.saved["node_states"])
        elif self.compression:
            log.warning("this engine keeps no client state across a resume: uplink residuals restart at zero")
        return grid


class Population(RunHook):
    """Client ``i`` is partition ``i`` on every engine: the strategy samples over the nodes in partition order."""

    def __init__(self, population: int) -> None:
        self.population = population

    def start(self, strategy: DPFedAvg, grid: Grid) -> Grid:
        strategy.use_population(discover_nodes(grid, self.population), labels=range(self.population))
        return grid


class Tracking(RunHook):
    """The ``tracking`` section's loggers (:mod:`fedprivacy.tracking`), opened by the run around ``start()``: the
    rows a checkpoint holds, once it is written (and at the start, the checkpointed rows a tracker may lack)."""

    def __init__(self, outputs: RunOutputs) -> None:
        self.outputs = outputs
        self.tracker: RunTracker | None = None

    def start(self, strategy: DPFedAvg, grid: Grid) -> Grid:
        self.checkpointed()
        return grid

    def checkpointed(self) -> None:
        assert self.tracker is not None, "open the tracker around start()"
        self.tracker.log_rows(self.outputs.rows)
