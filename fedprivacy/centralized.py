"""Centralized record-level DP training on a pooled data set, with the sample-level optimizers.

The papers' own experiments are centralized (DP-AdamBC, DiSK, DP-MicroAdam, AdaDPS §6.1): one data
set, Poisson batches at ``q = B / n``, each step the record-level Gaussian mechanism of
:mod:`fedprivacy.optim.sample_dp`, ε (>= 0) of the steps Opacus' accountant counted. This is
the harness of the small reproductions in ``simulations/`` and the pooled baseline of a federated
run (``pooled`` concatenates the clients' records; there is no user structure, so its ε is
record-level, not user-level).
"""

from __future__ import annotations

from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import torch
from torch import nn
from torch.utils.data import ConcatDataset, Dataset

from fedprivacy.client.sample_dp import LossFn, SampleDPRun, run_sample_dp
from fedprivacy.optim.sample_dp import SampleDPConfig, SampleDPOptimizer
from fedprivacy.privacy.accounting import AccountantKind


@dataclass(frozen=True)
class CentralizedResult:
    """A centralized run: evaluations, privacy spent, and the run itself."""

    history: list[tuple[int, float]]
    """``(step, evaluate(model))`` every ``eval_every`` steps and after the last step."""
    epsilon: float
    target_delta: float
    steps: int
    run: SampleDPRun


def pooled(datasets: Iterable[Dataset]) -> Dataset:
    """All clients' records as one data set (one record = one privacy unit)."""
    return ConcatDataset(list(datasets))


def train_centralized(model: nn.Module, dataset: Dataset, cfg: SampleDPConfig, *, seed: np.random.SeedSequence | int,
                      target_delta: float, loss_fn: LossFn, steps: int | None = None, epochs: float | None = None,
                      evaluate: Callable[[nn.Module], float] | None = None, eval_every: int = 0,
                      preconditioner: Sequence[torch.Tensor] | None = None, accountant: AccountantKind = "rdp",
                      on_step: Callable[[int, SampleDPOptimizer], None] | None = None) -> CentralizedResult:
    """Train ``model`` in place on ``dataset``; see :func:`fedprivacy.client.sample_dp.run_sample_dp`.

    Args:
        model, dataset, cfg, seed, loss_fn, steps, epochs, preconditioner, accountant: as
            :func:`~fedprivacy.client.sample_dp.run_sample_dp`.
        target_delta: δ of the reported ε.
        evaluate: ``evaluate(model) -> float`` (e.g. full training loss), run every ``eval_every``
            steps (0: only at the end) and after the last step; evaluation data is not privatized.
        on_step: extra per-step callback ``on_step(t, optimizer)``.
    """
    history: list[tuple[int, float]] = []

    def after_step(t: int, optimizer: SampleDPOptimizer) -> None:
        if evaluate is not None and eval_every and t % eval_every == 0:
            with torch.no_grad():
                history.append((t, float(evaluate(model))))
        if on_step is not None:
            on_step(t, optimizer)

    run = run_sample_dp(model, dataset, cfg, seed, steps=steps, epochs=epochs, loss_fn=loss_fn,
                        preconditioner=preconditioner, accountant=accountant, on_step=after_step)
    if evaluate is not None and (not history or history[-1][0] != run.steps):
        with torch.no_grad():
            history.append((run.steps, float(evaluate(model))))
    return CentralizedResult(history, run.epsilon(target_delta), target_delta, run.steps, run)
