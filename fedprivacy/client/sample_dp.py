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

:func:`train_sample_dp_softmax` is the same round for softmax regression on sparse (CSR) rows, the
StackOverflow tag model: Opacus cannot take CSR input, so each batch's clipped sum is computed
exactly in closed form (ghost norms, :func:`softmax_regression_clipped_sum`) and enters the same
optimizer at its noise stage. The ClientApp reports each round's releases in its reply metrics
(:func:`fedprivacy.privacy.client_ledgers.event_metrics`); the server composes them per client.

Delta. Each client's ε is at its own δ_i, which must be well below 1/n_i, n_i the client's
privacy units (records; micro-batches of ``micro_batch_size``, and a client with fewer records than
that has one unit of all of them). Publishing each unit independently with probability δ is
(0, δ)-DP yet publishes δ·n_i units in expectation: values of δ on the order of 1/n are "very
dangerous", permitting the complete records of a few participants to be published (Dwork & Roth,
*The Algorithmic Foundations of Differential Privacy*, 2014, §2.3, after Def. 2.4). The default
(:func:`client_delta`) is

.. math:: \delta_i = \frac{f}{n_i}, \qquad f = \mathtt{delta\_factor} = 0.1 \ (0 < f < 1),

under which that mechanism publishes a tenth of a unit in expectation on every client alike, and
δ_i < 1/n_i <= 1 for every client (δ = 0.1 for a single record). A fixed ``target_delta`` gives
every client the same δ instead; a client where that is >= 1/n_i is flagged (``weak_delta`` in
``client_privacy.csv``, a count in ``summary.json``, a warning:
:mod:`fedprivacy.privacy.client_ledgers`), not refused. Every ε goes through
:func:`fedprivacy.privacy.accounting.epsilon`: >= 0, ``inf`` when z = 0 (:func:`counted_epsilon`).

Randomness: one ``SeedSequence`` is split into four disjoint streams: micro-batch partition,
Poisson sampling, noise (dedicated; ``secure_noise`` seeds it from the OS instead) and
DP-MicroAdam's rounding. Nothing draws from the global torch RNG. The noise generator lives on the
model's device (a CUDA run draws its noise there); sampling and partition stay on the CPU.

On a GPU the step loops do not wait for the device: batches go to it with ``non_blocking`` copies
and the batch losses stay there until the run ends (:func:`~fedprivacy.client.tensors.host_floats`).
"""

from __future__ import annotations

import math
import secrets
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace

import numpy as np
import scipy.sparse as sp
import torch
from opacus import GradSampleModule
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.data_loader import DPDataLoader
from torch import nn
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.utils.data import Dataset, TensorDataset

from fedprivacy.client.tensors import host_floats
from fedprivacy.optim.sample_dp import SampleDPConfig, SampleDPOptimizer, clip_factors, make_sample_dp_optimizer
from fedprivacy.privacy.accounting import AccountantKind, GaussianRound, PrivacyLedger, epsilon
from fedprivacy.privacy.noise import torch_seed

LossFn = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def _torch_generator(seq: np.random.SeedSequence, device: torch.device | str = "cpu") -> torch.Generator:
    return torch.Generator(device=device).manual_seed(torch_seed(seq))


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
                       targets: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Forward and backward of the SUMMED loss on one fixed batch; returns the mean loss per record
    (a 0-d tensor on the model's device, so the step does not wait for it).

    ``loss_fn(outputs, targets)`` must return per-record losses (``reduction="none"``). An empty
    batch gets zero-row ``grad_sample`` tensors (its step is noise only) and a NaN loss.
    """
    def closure() -> torch.Tensor:
        if len(inputs) == 0:
            params = [p for p in model.parameters() if p.requires_grad]
            for p in params:
                p.grad_sample = p.new_zeros((0, *p.shape))
            return params[0].new_tensor(math.nan)
        losses = loss_fn(model(inputs), targets)
        losses.sum().backward()
        return losses.detach().mean()
    return closure


DELTA_FACTOR = 0.1
"""Default f of the per-client delta policy delta_i = f / n_i (module docstring, "Delta")."""


def client_delta(units: int, target_delta: float | None = None, delta_factor: float = DELTA_FACTOR) -> float:
    """δ_i of a client with ``units`` privacy units: ``target_delta`` if given, else ``delta_factor / units``."""
    if target_delta is not None:
        return target_delta
    if not 0 < delta_factor < 1:
        raise ValueError(f"delta_factor must be in (0, 1), got {delta_factor!r}")
    return delta_factor / units


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

    def epsilon(self, delta: float) -> float:
        """ε at ``delta`` of the steps the accountant counted (see :func:`counted_epsilon`)."""
        return counted_epsilon(self.accountant, self.event, delta)


def counted_epsilon(accountant: RDPAccountant | PRVAccountant, event: GaussianRound, delta: float) -> float:
    """ε at ``delta`` of the steps a hooked Opacus ``accountant`` counted, each a release of ``event``.

    Computed by :func:`fedprivacy.privacy.accounting.epsilon` (the same Opacus RDP/PRV analysis,
    reported >= 0, ``inf`` for z = 0) rather than by ``accountant.get_epsilon``, which goes negative
    at large δ and whose PRV raises there.
    """
    taken = sum(count for *_, count in accountant.history)
    return epsilon([(event, taken)] if taken else [], delta, accountant.mechanism())


@dataclass(frozen=True)
class _Plan:
    """A run's privacy units, sampling, optimizer (accountant hooked) and event: what every trainer shares."""

    cfg: SampleDPConfig
    """The run's settings: ``batch_size = q n k`` and the unit size ``k`` actually used."""
    units: Dataset
    q: float
    steps: int
    optimizer: SampleDPOptimizer
    accountant: RDPAccountant | PRVAccountant
    event: GaussianRound
    sampling_generator: torch.Generator


def _plan(params: list[nn.Parameter], dataset: Dataset, cfg: SampleDPConfig, seed: np.random.SeedSequence | int, *,
          steps: int | None, epochs: float | None, preconditioner: Sequence[torch.Tensor] | None,
          accountant: AccountantKind, secure_noise: bool) -> _Plan:
    """Units, ``q = min(1, B/n)``, the step count, the optimizer over ``params`` and its accountant (:func:`run_sample_dp`)."""
    if (steps is None) == (epochs is None):
        raise ValueError("give exactly one of steps and epochs")
    seq = seed if isinstance(seed, np.random.SeedSequence) else np.random.SeedSequence(seed)
    partition_seq, sampling_seq, noise_seq, rounding_seq = seq.spawn(4)
    if len(dataset) == 0:
        raise ValueError("sample-level DP training needs at least one record")
    k = min(cfg.micro_batch_size, len(dataset))  # fewer records than k: one unit of all of them
    units = MicroBatchUnits(dataset, k, _torch_generator(partition_seq)) if k > 1 else dataset
    n_units = len(units)
    q = min(1.0, cfg.expected_units / n_units)
    cfg = replace(cfg, batch_size=q * n_units * k, micro_batch_size=k)
    steps = max(1, round(epochs / q)) if steps is None else steps
    device = params[0].device  # the noise is drawn where the gradients are
    # secure: the noise AND the Poisson record sampling are secret (amplification assumes a secret batch)
    noise_gen = (torch.Generator(device=device).manual_seed(secrets.randbits(63)) if secure_noise
                 else _torch_generator(noise_seq, device))
    sampling_gen = (torch.Generator().manual_seed(secrets.randbits(63)) if secure_noise
                    else _torch_generator(sampling_seq))
    optimizer = make_sample_dp_optimizer(params, cfg, generator=noise_gen, preconditioner=preconditioner,
                                         seed=int(rounding_seq.generate_state(1)[0]))
    acct = make_accountant(accountant)
    optimizer.attach_step_hook(acct.get_optimizer_hook_fn(sample_rate=q))
    event = GaussianRound(cfg.noise_multiplier, "poisson", n_units, q * n_units)
    return _Plan(cfg, units, q, steps, optimizer, acct, event, sampling_gen)


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
            capped at 1 and B lowered to ``n`` (every unit every step, no amplification); with
            fewer records than ``micro_batch_size`` all of them form one unit.
        seed: the run's seed sequence (or an int), split into the module docstring's streams.
        steps: number of steps; or ``epochs``: ``steps = max(1, round(epochs / q))``.
        loss_fn: per-record loss (``reduction="none"``).
        preconditioner: AdaDPS ``A`` (public), one tensor per trainable parameter.
        accountant: ``"rdp"`` or ``"prv"`` (Opacus), fed by the optimizer's step hook.
        secure_noise: seed the noise generator and the record sampling from the OS's cryptographic source.
        on_step: called as ``on_step(t, optimizer)`` after step ``t`` (1-based), e.g. to evaluate;
            ``p.grad`` then holds the gradient the base optimizer used (DiSK: the filtered one).

    Raises:
        ValueError: neither or both of ``steps`` and ``epochs``; no records.
    """
    params = [p for p in model.parameters() if p.requires_grad]  # the GradSampleModule's, same objects
    plan = _plan(params, dataset, cfg, seed, steps=steps, epochs=epochs, preconditioner=preconditioner,
                 accountant=accountant, secure_noise=secure_noise)
    optimizer, k = plan.optimizer, plan.cfg.micro_batch_size
    gsm = GradSampleModule(model, loss_reduction="sum")
    device, losses = params[0].device, []
    try:
        for t, batch in enumerate(poisson_batches(plan.units, plan.q, plan.steps, plan.sampling_generator), start=1):
            inputs, targets = (part.to(device, non_blocking=True) for part in flatten_units(batch, k))
            optimizer.zero_grad(set_to_none=True)
            losses.append(optimizer.step(per_sample_closure(gsm, loss_fn, inputs, targets)))
            if on_step is not None:
                on_step(t, optimizer)
    finally:
        optimizer.zero_grad(set_to_none=True)
        gsm._close()
    return SampleDPRun(optimizer, plan.accountant, plan.event, plan.steps, host_floats(losses))


@dataclass(frozen=True)
class SampleDPResult:
    """One client's round of record-level DP training.

    Attributes:
        delta: flat ``x_local - x_start`` in ``parameters_to_vector(model.parameters())`` order.
        epsilon: ε >= 0 of THIS participation at ``target_delta`` (:func:`counted_epsilon`).
        steps: local steps taken.
        event: one step's release, for :meth:`ClientPrivacyAccountant.record`.
        target_delta: the δ of ``epsilon``: the client's δ_i (:func:`client_delta`).
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
                    *, epochs: float = 1.0, target_delta: float | None = None,
                    delta_factor: float = DELTA_FACTOR, loss_fn: LossFn | None = None,
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
        target_delta: δ of the reported ε; None: ``delta_factor / n_i`` (:func:`client_delta`).
        delta_factor: f of the default δ_i = f / n_i, in (0, 1).
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
    delta = client_delta(run.event.population, target_delta, delta_factor)
    seen = [x for x in run.losses if not math.isnan(x)]
    return SampleDPResult(update, run.epsilon(delta), run.steps, run.event, delta,
                          sum(seen) / len(seen) if seen else math.nan, len(examples))


@dataclass(frozen=True)
class ClippedSum:
    """:func:`softmax_regression_clipped_sum` of one batch: per-parameter sums, unit norms, record losses."""

    weight: torch.Tensor
    bias: torch.Tensor
    unit_norms: torch.Tensor
    losses: torch.Tensor


@torch.no_grad()
def softmax_regression_clipped_sum(x: sp.csr_matrix, y: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor,
                                   clip_norm: float, micro_batch_size: int = 1, *,
                                   lookahead: tuple[torch.Tensor, torch.Tensor] | None = None, c: float = 0.0,
                                   preconditioner: tuple[torch.Tensor, torch.Tensor | None] | None = None
                                   ) -> ClippedSum:
    r"""Exact clipped sum of per-unit gradients of softmax regression on sparse rows, without materializing them.

    Logits :math:`z_i = W^\top x_i + b` (``W``: ``(V, K)``), loss :math:`-\log \mathrm{softmax}(z_i)_{y_i}`,
    so record ``i``'s gradient is :math:`(x_i r_i^\top,\ r_i)` with :math:`r_i = p_i - e_{y_i}`.

    AdaDPS (arXiv:2202.05963v2, Alg. 1, 𝒜 = g / A): with ``preconditioner`` :math:`(A_W, A_b)` (public;
    :math:`A_W` broadcastable to ``(V, K)``, e.g. ``(V, 1)`` for one value per word, :math:`A_b` ``(K,)``
    or None for 1) each record's gradient is divided by A BEFORE the clip:
    :math:`\big((x_i r_i^\top) \oslash A_W,\ r_i \oslash A_b\big)`. A unit ``j`` of ``k`` records has the
    mean :math:`u_j` of those, whose squared norm needs only ``k^2`` sparse products, with
    :math:`M = A_W^{-2}` and :math:`m_b = A_b^{-2}`:

    .. math:: \lVert u_j \rVert^2 = \frac{1}{k^2} \sum_{i, l \in j} \sum_c r_{ic} r_{lc}
              \big( [(x_i \odot x_l)^\top M]_c + (m_b)_c \big)

    (:math:`A = 1` gives the ghost norm :math:`(x_i \cdot x_l + 1)(r_i \cdot r_l)`). With
    :math:`c_j = \min(1, C / \lVert u_j \rVert_2)` and :math:`s_i = c_{j(i)} / k`, the clipped sum is one
    sparse product: :math:`\sum_j c_j u_j = \big((X^\top \mathrm{diag}(s) R) \oslash A_W,\ (R^\top s) \oslash A_b\big)`.

    DiSK (arXiv:2410.03883, Alg. 3 line 5): with ``lookahead`` :math:`(W', b')` each record's
    two-point combination :math:`c\,\nabla f(W', b'; \xi_i) + (1-c)\,\nabla f(W, b; \xi_i)` is again
    :math:`(x_i r_i^\top, r_i)` with :math:`r_i = c\,p_i(W', b') + (1-c)\,p_i(W, b) - e_{y_i}` (the
    input factor is the same at both points), so ``R`` above holds these :math:`r_i` and the ONE
    clip applies to the (preconditioned) combination. ``losses`` stay those at :math:`(W, b)`.

    Args:
        x: ``(b k, V)`` CSR rows, units of ``k`` consecutive rows.
        y: ``(b k,)`` int64 labels.
        weight, bias: the model's ``W`` and ``b``; results are in their dtype and device.
        clip_norm: C.
        micro_batch_size: k.
        lookahead: DiSK's :math:`(W', b') = x_t + \gamma d_{t-1}`, or None (one point).
        c: DiSK's :math:`(1-\kappa)/(\kappa\gamma)` (ignored without ``lookahead``).
        preconditioner: AdaDPS's :math:`(A_W, A_b)`, or None (A = 1).
    """
    n, vocab = x.shape
    k = micro_batch_size
    if n % k:
        raise ValueError(f"batch of {n} records is not whole micro-batches of {k}")
    dtype, device = weight.dtype, weight.device
    xs, xt = _sparse_pair(x, dtype, device)
    logits = torch.sparse.mm(xs, weight) + bias
    losses = nn.functional.cross_entropy(logits, y, reduction="none")
    r = torch.softmax(logits, dim=1)
    if lookahead is not None:  # DiSK: combine the two points' probabilities before the clip
        r = c * torch.softmax(torch.sparse.mm(xs, lookahead[0]) + lookahead[1], dim=1) + (1.0 - c) * r
    r[torch.arange(n, device=device), y] -= 1.0
    inv_w, inv_b = (None, None) if preconditioner is None else (
        1.0 / preconditioner[0].to(dtype=dtype, device=device),
        None if preconditioner[1] is None else 1.0 / preconditioner[1].to(dtype=dtype, device=device))
    m_w = torch.ones(vocab, 1, dtype=dtype, device=device) if inv_w is None else (inv_w ** 2).expand(vocab, -1)
    m_b = 1.0 if inv_b is None else inv_b ** 2
    units_r = r.view(n // k, k, r.shape[1])
    squared = torch.zeros(n // k, dtype=dtype, device=device)
    x64 = x.astype(np.float64)  # products of float32 inputs in float64, as the logits' own precision allows
    rows_at = [x64[a::k] for a in range(k)]  # record a of every unit
    for a in range(k):
        for b in range(a, k):
            pair, _ = _sparse_pair(rows_at[a].multiply(rows_at[b]).tocsr(), dtype, device)  # x_i * x_l, elementwise
            term = (units_r[:, a] * units_r[:, b] * (torch.sparse.mm(pair, m_w) + m_b)).sum(dim=1)
            squared += term if a == b else 2.0 * term
    norms = squared.clamp_min(0.0).sqrt() / k
    scale = (clip_factors(norms, clip_norm) / k).repeat_interleave(k)
    scaled = r * scale[:, None]
    weight_sum, bias_sum = torch.sparse.mm(xt, scaled), scaled.sum(0)
    if inv_w is not None:
        weight_sum.mul_(inv_w)
    if inv_b is not None:
        bias_sum.mul_(inv_b)
    return ClippedSum(weight_sum, bias_sum, norms, losses)


def _sparse_pair(x: sp.csr_matrix, dtype: torch.dtype, device) -> tuple[torch.Tensor, torch.Tensor]:
    """``x`` and its transpose as torch sparse COO tensors (indices in range by construction: unchecked)."""
    coo = x.tocoo()
    indices = torch.from_numpy(np.stack([coo.row, coo.col]).astype(np.int64)).to(device, non_blocking=True)
    values = torch.from_numpy(coo.data).to(dtype).to(device, non_blocking=True)
    n, vocab = x.shape
    return (torch.sparse_coo_tensor(indices, values, (n, vocab), check_invariants=False),
            torch.sparse_coo_tensor(indices.flip(0), values, (vocab, n), check_invariants=False))


def train_sample_dp_softmax(model: nn.Module, features: sp.csr_matrix, labels: np.ndarray, cfg: SampleDPConfig,
                            seed: np.random.SeedSequence | int, *, epochs: float = 1.0,
                            target_delta: float | None = None, delta_factor: float = DELTA_FACTOR,
                            accountant: AccountantKind = "rdp", secure_noise: bool = False,
                            preconditioner: tuple[torch.Tensor, torch.Tensor | None] | None = None) -> SampleDPResult:
    """:func:`train_sample_dp` for softmax regression on sparse rows (``model.embedding.weight``, ``model.bias``).

    The same mechanism, units, sampling streams, accounting and result; only the per-unit
    gradients differ: Opacus' ``GradSampleModule`` cannot take CSR input (and its ``EmbeddingBag``
    sampler ignores ``per_sample_weights``), so each Poisson batch's clipped sum comes in closed
    form from :func:`softmax_regression_clipped_sum` and goes through
    :meth:`~fedprivacy.optim.sample_dp.SampleDPOptimizer.step_clipped_sum` (dense noise
    N(0, σ²C²) on EVERY coordinate, divide by B, account, base step). The update is therefore
    dense. AdaDPS: ``preconditioner`` :math:`(A_W, A_b)` divides each record's gradient before the
    clip (inside the closed form). DiSK (``cfg.disk_kappa < 1``): each step's clipped sum is of the
    two-point combination at ``x_t`` and the optimizer's lookahead, on the same Poisson batch, clipped
    once (:meth:`~fedprivacy.optim.sample_dp.SampleDPOptimizer.step_disk_clipped_sum`), so the
    accountant composes one release per step, as without DiSK. The model holds ``x_t`` again afterwards.

    Args:
        model: holds ``embedding.weight`` ``(V, K)`` and ``bias`` ``(K,)`` (its only trainable parameters),
            e.g. :class:`~fedprivacy.models.logistic.SparseLogisticRegression`.
        features: the client's ``(n, V)`` CSR rows; ``labels``: its ``n`` labels.
        cfg, seed, epochs, target_delta, delta_factor, accountant, secure_noise: as in :func:`train_sample_dp`.
        preconditioner: AdaDPS's public :math:`(A_W, A_b)` (see :func:`softmax_regression_clipped_sum`), or None.
    """
    weight, bias = model.embedding.weight, model.bias
    params = [p for p in model.parameters() if p.requires_grad]
    if len(params) != 2 or not any(p is weight for p in params) or not any(p is bias for p in params):
        raise ValueError("train_sample_dp_softmax needs a model whose trainable parameters are embedding.weight and bias")
    n = features.shape[0]
    plan = _plan(params, TensorDataset(torch.arange(n)), cfg, seed, steps=None, epochs=epochs, preconditioner=None,
                 accountant=accountant, secure_noise=secure_noise)
    y_all = torch.from_numpy(np.asarray(labels, dtype=np.int64))
    start = parameters_to_vector(params).detach().clone()
    optimizer, k = plan.optimizer, plan.cfg.micro_batch_size
    w_at = next(i for i, p in enumerate(optimizer.params) if p is weight)
    losses = []
    try:
        for batch in poisson_batches(plan.units, plan.q, plan.steps, plan.sampling_generator):
            rows = flatten_units(batch, k)[0]
            x, y = features[rows.numpy()], y_all[rows].to(weight.device, non_blocking=True)
            sums = []

            def clipped_sum(ahead: list[torch.Tensor] | None = None, c: float = 0.0) -> list[torch.Tensor]:
                point = None if ahead is None else (ahead[w_at], ahead[1 - w_at])
                sums.append(softmax_regression_clipped_sum(x, y, weight.detach(),
                                                           bias.detach(), cfg.clip_norm, k,
                                                           lookahead=point, c=c, preconditioner=preconditioner))
                return [sums[-1].weight if p is weight else sums[-1].bias for p in optimizer.params]

            optimizer.zero_grad(set_to_none=True)
            if optimizer.disk is None:
                optimizer.step_clipped_sum(clipped_sum())
            else:
                optimizer.step_disk_clipped_sum(clipped_sum)
            if len(rows):
                losses.append(sums[-1].losses.mean())
        update = parameters_to_vector(params).detach() - start
    finally:
        optimizer.zero_grad(set_to_none=True)
        with torch.no_grad():
            vector_to_parameters(start, params)
    delta = client_delta(plan.event.population, target_delta, delta_factor)
    return SampleDPResult(update, counted_epsilon(plan.accountant, plan.event, delta), plan.steps, plan.event,
                          delta, sum(host_floats(losses)) / len(losses) if losses else math.nan, n)


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
