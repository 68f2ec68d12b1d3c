r"""Record-level DP training with Opacus: the shared step loop, one client round, per-client accounting.

A run of ``T`` steps of a :class:`~fedprivacy.optim.sample_dp.SampleDPOptimizer` on a data set of
``n`` privacy units (records, or micro-batches of ``k`` records) is ``T`` Poisson-subsampled
Gaussian mechanisms:

.. math::
    q = \min\Big(1, \frac{B}{n}\Big), \qquad
    \varepsilon = \mathrm{RDP}\big(\textstyle\sum_{t \le T} \mathrm{PoissonSampled}(q, \mathcal N(0, \sigma^2))\big)

(``B`` = ``cfg.expected_units``). Batches come from Opacus' ``DPDataLoader`` (Poisson sampling, a
dedicated sampling generator; empty batches still take a noisy step), per-sample gradients from
``GradSampleModule`` (``loss_reduction="sum"``: ``grad_sample`` is each record's own gradient), and
Opacus' accountant is attached as the optimizer's step hook, so ε counts the steps actually taken.

:func:`train_sample_dp` is one federated round on one client: the client's own ``q_i = B/n_i``,
its local steps, the flat model delta, and the ε of this participation.
:class:`ClientPrivacyAccountant` composes a client's participations over rounds (the ledger of
:mod:`fedprivacy.privacy.accounting`, one entry per participation, JSON-able for ``Context.state``).
This is record-level DP for each client's own data, accounted per client and reported separately
from the server's user-level guarantee (ARCHITECTURE "Noise placements").

Randomness: one ``SeedSequence`` is split into four disjoint streams: micro-batch partition,
Poisson sampling, noise (dedicated; ``secure_noise`` seeds it from the OS instead) and
DP-MicroAdam's rounding. Nothing draws from the global torch RNG.
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import torch
from opacus import GradSampleModule
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.data_loader import DPDataLoader
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import Dataset

from fedprivacy.optim.sample_dp import SampleDPConfig, SampleDPOptimizer, make_sample_dp_optimizer
from fedprivacy.privacy.accounting import AccountantKind, GaussianRound, PrivacyLedger, epsilon

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_generator(seq: np.random.SeedSequence) -> torch.Generator:
    return torch.Generator().manual_seed(int(seq.generate_state(1, np.uint64)[0] >> 1))


class MicroBatchUnits(Dataset):
    """A data set of privacy units: a fixed partition of ``dataset`` into micro-batches of ``k`` records.

    The partition is a permutation drawn once from ``generator``, independent of the data; the
    ``n mod k`` records left over are never used. Item ``j`` stacks its ``k`` records, so a batch of
    ``b`` units has leading shape ``(b, k)``; :func:`flatten_units` turns it into ``b*k`` rows in
    unit-major order (what :class:`SampleDPOptimizer` averages per unit).
    """

    def __init__(self, dataset: Dataset, k: int, generator: torch.Generator) -> None:
        if k < 1 or len(dataset) < k:
            raise ValueError(f"need 1 <= micro_batch_size <= len(dataset), got k={k}, n={len(dataset)}")
        self.dataset = dataset
        self.k = k
        order = torch.randperm(len(dataset), generator=generator)
        self.groups = order[: (len(dataset) // k) * k].view(-1, k).tolist()

    def __len__(self) -> int:
        return len(self.groups)

    def __getitem__(self, j: int):
        records = [self.dataset[i] for i in self.groups[j]]
        return tuple(torch.stack([torch.as_tensor(r[f]) for r in records]) for f in range(len(records[0])))


def flatten_units(batch: Sequence[torch.Tensor], k: int) -> list[torch.Tensor]:
    """Merge the ``(units, k)`` leading dimensions of a :class:`MicroBatchUnits` batch (k = 1: unchanged)."""
    return list(batch) if k == 1 else [t.reshape(-1, *t.shape[2:]) for t in batch]


def poisson_batches(units: Dataset, sample_rate: float, steps: int, generator: torch.Generator) -> Iterator:
    """``steps`` Poisson-sampled batches (each unit independently w.p. ``sample_rate``) via Opacus' DPDataLoader."""
    loader = DPDataLoader(units, sample_rate=sample_rate, generator=generator)
    taken = 0
    while taken < steps:
        for batch in loader:
            yield batch
            taken += 1
            if taken == steps:
                return


def per_sample_closure(model: GradSampleModule, loss_fn: LossFn, inputs: torch.Tensor,
                       targets: torch.Tensor) -> Callable[[], float]:
    """Forward and backward of the SUMMED loss on one fixed batch; returns the mean loss per record.

    ``loss_fn(outputs, targets)`` must return per-record losses (``reduction="none"``). An empty
    batch gets zero-row ``grad_sample`` tensors (its step is noise only) and a NaN loss.
    """
    def closure() -> float:
        if len(inputs) == 0:
            for p in model.parameters():
                if p.requires_grad:
                    p.grad_sample = p.new_zeros((0, *p.shape))
            return math.nan
        losses = loss_fn(model(inputs), targets)
        losses.sum().backward()
        return float(losses.detach().mean())
    return closure


def make_accountant(kind: AccountantKind) -> RDPAccountant | PRVAccountant:
    """Opacus' accountant of ``kind`` (``"rdp"`` or ``"prv"``)."""
    if kind == "rdp":
        return RDPAccountant()
    if kind == "prv":
        return PRVAccountant()
    raise ValueError(f"sample-level accounting supports 'rdp' and 'prv', got {kind!r}")


@dataclass(frozen=True)
class SampleDPRun:
    """What :func:`run_sample_dp` leaves behind (the model itself is trained in place)."""

    optimizer: SampleDPOptimizer
    accountant: RDPAccountant | PRVAccountant
    event: GaussianRound
    """One step's release: Poisson rate ``q`` over ``population`` units, multiplier σ."""
    steps: int
    losses: list[float]
    """Mean training loss of each step's batch (NaN for an empty batch)."""


def run_sample_dp(model: nn.Module, dataset: Dataset, cfg: SampleDPConfig, seed: np.random.SeedSequence | int, *,
                  steps: int | None = None, epochs: float | None = None, loss_fn: LossFn,
                  preconditioner: Sequence[torch.Tensor] | None = None, accountant: AccountantKind = "rdp",
                  secure_noise: bool = False,
                  on_step: Callable[[int, SampleDPOptimizer], None] | None = None) -> SampleDPRun:
    """Train ``model`` in place with record-level DP: Poisson batches, clip, noise, base step, account.

    Args:
        model: a plain module (wrapped in a ``GradSampleModule`` for the run, unwrapped after).
        dataset: items ``(input, target)``; one item = one record.
        cfg: hyperparameters; with ``q = B/n > 1`` (fewer units than the expected batch) q is
            capped at 1 and B lowered to ``n`` (every unit every step, no amplification).
        seed: the run's seed sequence (or an int), split into the module docstring's streams.
        steps: number of steps; or ``epochs``: ``steps = max(1, round(epochs / q))``.
        loss_fn: per-record loss (``reduction="none"``).
        preconditioner: AdaDPS ``A`` (public), one tensor per trainable parameter.
        accountant: ``"rdp"`` or ``"prv"`` (Opacus), fed by the optimizer's step hook.
        secure_noise: seed the noise generator from the OS's cryptographic source.
        on_step: called as ``on_step(t, optimizer)`` after step ``t`` (1-based), e.g. to evaluate;
            ``p.grad`` then holds the gradient the base optimizer used (DiSK: the filtered one).

    Raises:
        ValueError: neither or both of ``steps`` and ``epochs``; too few records for one unit.
    """
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps and epochs")
    seq = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    partition_seq, sampling_seq, noise_seq, rounding_seq = seq.spawn(4)
    k = cfg.micro_batch_size
    units = MicroBatchUnits(dataset, k, _torch_generator(partition_seq)) if k > 1 else dataset
    n_units = len(units)
    q = min(1.0, cfg.expected_units / n_units)
    cfg = replace(cfg, batch_size=q * n_units * k)
    steps = max(1, round(epochs / q)) if steps is None else steps
    noise_gen = (torch.Generator().manual_seed(secrets.randbits(63)) if secure_noise
                 else _torch_generator(noise_seq))
    gsm = GradSampleModule(model, loss_reduction="sum")
    params = [p for p in gsm.parameters() if p.requires_grad]
    optimizer = make_sample_dp_optimizer(params, cfg, generator=noise_gen, preconditioner=preconditioner,
                                         seed=int(rounding_seq.generate_state(1)[0]))
    acct = make_accountant(accountant)
    optimizer.attach_step_hook(acct.get_optimizer_hook_fn(sample_rate=q))
    losses = []
    try:
        for t, batch in enumerate(poisson_batches(units, q, steps, _torch_generator(sampling_seq)), start=1):
            inputs, targets = flatten_units(batch, k)
            optimizer.zero_grad(set_to_none=True)
            losses.append(optimizer.step(per_sample_closure(gsm, loss_fn, inputs, targets)))
            if on_step is not None:
                on_step(t, optimizer)
    finally:
        optimizer.zero_grad(set_to_none=True)
        gsm._close()
    event = GaussianRound(cfg.noise_multiplier, "poisson", n_units, q * n_units)
    return SampleDPRun(optimizer, acct, event, steps, losses)


@dataclass(frozen=True)
class SampleDPResult:
    """One client's round of record-level DP training.

    Attributes:
        delta: flat ``x_local - x_start`` in ``parameters_to_vector(model.parameters())`` order.
        epsilon: ε of THIS participation at ``target_delta`` (Opacus accountant, steps actually taken).
        steps: local steps taken.
        event: one step's release, for :meth:`ClientPrivacyAccountant.record`.
        target_delta: the δ of ``epsilon``.
        train_loss: mean of the steps' batch losses (non-empty batches; NaN if all were empty).
        num_examples: records the client holds (diagnostic only; never a weight).
    """

    delta: torch.Tensor
    epsilon: float
    steps: int
    event: GaussianRound
    target_delta: float
    train_loss: float
    num_examples: int


def train_sample_dp(model: nn.Module, examples: Dataset, cfg: SampleDPConfig, seed: np.random.SeedSequence | int,
                    *, epochs: float = 1.0, target_delta: float | None = None, loss_fn: LossFn | None = None,
                    preconditioner: Sequence[torch.Tensor] | None = None, accountant: AccountantKind = "rdp",
                    secure_noise: bool = False) -> SampleDPResult:
    """One client's local record-level DP training from the model's current weights ``x_t``.

    The model holds ``x_t`` again afterwards (one working model serves every client), and all
    optimizer state (Adam moments, DiSK filter, MicroAdam ring) is local to this call.

    Args:
        model: the global model at ``x_t`` (plain module; trained on a copy of its weights).
        examples: the client's records, items ``(input, target)``.
        cfg: the sample-level optimizer (:class:`~fedprivacy.optim.sample_dp.SampleDPConfig`).
        seed: e.g. ``SeedSequence([run_seed, STREAM, round, client])``.
        epochs: local epochs; steps = ``max(1, round(epochs / q_i))`` with ``q_i = B / n_i``.
        target_delta: δ of the reported ε (default ``1 / n_i``).
        loss_fn: per-record loss; default cross-entropy with ``reduction="none"``.
        preconditioner: AdaDPS ``A`` (public, broadcast with the model).
        accountant: ``"rdp"`` or ``"prv"``.
        secure_noise: OS-seeded noise generator.
    """
    loss_fn = loss_fn or (lambda out, y: nn.functional.cross_entropy(out, y, reduction="none"))
    params = [p for p in model.parameters() if p.requires_grad]
    start = parameters_to_vector(params).detach().clone()
    try:
        run = run_sample_dp(model, examples, cfg, seed, epochs=epochs, loss_fn=loss_fn,
                            preconditioner=preconditioner, accountant=accountant, secure_noise=secure_noise)
        update = parameters_to_vector(params).detach() - start
    finally:
        with torch.no_grad():
            vector_to_parameters(start, params)
    n = len(examples)
    target_delta = 1.0 / n if target_delta is None else target_delta
    seen = [x for x in run.losses if not math.isnan(x)]
    return SampleDPResult(update, float(run.accountant.get_epsilon(delta=target_delta)), run.steps, run.event,
                          target_delta, sum(seen) / len(seen) if seen else math.nan, n)


class ClientPrivacyAccountant:
    """A client's record-level privacy over the rounds it took part in (its own ``q_i``, its own steps).

    State is a :class:`~fedprivacy.privacy.accounting.PrivacyLedger` (JSON-able: keep
    :meth:`state_dict` in the client's ``Context.state``); rounds the client sat out add nothing.
    """

    def __init__(self, ledger: PrivacyLedger | None = None) -> None:
        self.ledger = ledger or PrivacyLedger()

    def record(self, result: SampleDPResult) -> ClientPrivacyAccountant:
        """Compose one participation: ``result.steps`` releases of ``result.event``; returns self."""
        self.ledger.compose(result.event, result.steps)
        return self

    def epsilon(self, target_delta: float, kind: AccountantKind = "rdp") -> float:
        """ε of every recorded participation together (Opacus RDP semantics for ``"rdp"``)."""
        return epsilon(self.ledger, target_delta, kind)

    def state_dict(self) -> dict:
        return self.ledger.state_dict()

    @classmethod
    def from_state_dict(cls, state: dict) -> ClientPrivacyAccountant:
        return cls(PrivacyLedger.from_state_dict(state))
