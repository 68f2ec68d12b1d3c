r"""Record-level DP (DP-SGD) for any model Opacus supports, inside a stock Flower ClientApp.

Each client trains its own model with Opacus' ``PrivacyEngine.make_private`` (per-record gradients,
flat clip to ``C``, one Gaussian draw per step, Poisson-sampled batches; Abadi et al., *Deep Learning
with Differential Privacy*, 2016, Alg. 1) and puts the round's releases in its reply, so the server
composes them per client (:mod:`fedprivacy.privacy.client_ledgers`) and the client sees its own ε:

.. code-block:: python

    with make_record_dp(model, optimizer, data_loader, noise_multiplier=1.0, max_grad_norm=1.0) as dp:
        for x, y in dp.data_loader:                  # Poisson batches
            dp.optimizer.zero_grad()
            loss_fn(dp.module(x), y).backward()      # mean loss over the batch
            dp.optimizer.step()                      # clip, noise, step, account
    metrics = MetricRecord({"num-examples": n, **dp.metrics()})  # model: trained in place, hooks removed

One round of ``T`` steps on ``n`` records is ``T`` Poisson-subsampled Gaussian mechanisms, the event
``GaussianRound(z, "poisson", n, q n)`` with Opacus' rate :math:`q = 1/\mathrm{len(data\_loader)}`
(``B = q n`` expected records per batch):

.. math:: \varepsilon_i = \varepsilon\big(T \times \mathrm{PoissonSampled}(q, \mathcal N(0, z^2 C^2)),\ \delta_i\big),
          \qquad \delta_i = \frac{f}{n} \ (f = \mathtt{delta\_factor} = 0.1)

The event and ``T`` are read from the accountant Opacus hooked to the optimizer (the steps actually
taken), and :meth:`RecordDP.metrics` is exactly :func:`~fedprivacy.privacy.client_ledgers.event_metrics`
of them, whose inverse :func:`~fedprivacy.privacy.client_ledgers.event_from_metrics` the server applies
(``DPFedAvg(record_level=True)`` composes each client's events over its rounds: ``client_epsilons()``);
``sample-dp-epsilon`` in it is this participation's ε at the client's own δ_i (for display; the server
composes the events, it does not add epsilons). δ_i is fedprivacy's policy
(:func:`fedprivacy.client.sample_dp.client_delta`: ``f / n`` unless a fixed ``target_delta`` is given;
Dwork & Roth 2014, §2.3, on why δ must be well below 1/n).

Randomness. Opacus' ``secure_mode`` needs ``torchcsprng``, which is not among fedprivacy's
dependencies, so, as :mod:`fedprivacy.client.sample_dp` does with
``secure_noise``, the noise generator (on the model's device) and the Poisson sampling generator are
dedicated ``torch.Generator`` s seeded from the OS's cryptographic source (``secrets``) unless a
``seed`` is given (reproducible simulation). Nothing draws from the global torch RNG or from the
user's ``DataLoader`` generator, which the device's own code may have seeded: amplification by
sampling assumes the server cannot know the batch, and the noise protects only if it cannot be
rebuilt. (PyTorch's generators are not themselves CSPRNGs; see :mod:`fedprivacy.privacy.noise`.)

One optimizer step per batch drawn: Opacus' accountant counts optimizer steps, each as one Poisson-
sampled release at z. Two steps on one batch release that batch twice (together, one step at
z / sqrt 2, more than two independent steps at z), and one step over two batches' gradients has another
sampling rate; so :class:`RecordDP` counts the batches its loader has yielded and refuses an event
(:attr:`RecordDP.event`, :meth:`RecordDP.metrics`) whose steps differ from them.

The Poisson loader is Opacus' ``DPDataLoader.from_data_loader(data_loader, generator=...)`` at the
rate ``1 / len(data_loader)`` that ``make_private`` accounts (``make_private``'s own loader would
sample from ``data_loader.generator``); the optimizer divides each noisy sum by Opacus'
``expected_batch_size`` (post-processing, not part of the event).

Why a helper and not a mod: a Flower mod sees only the messages around the train function, while
DP-SGD must own the model's backward pass, the optimizer and the batch sampling inside it; so the
user calls :func:`make_record_dp` in their train function and trains with what it returns, as a
context whose exit removes Opacus' hooks from the model (so the same model can be made private
again next round). It composes with :mod:`fedprivacy.fl.mods` (a user-level clip and noise on top
of the record-level one).
"""

from __future__ import annotations

import secrets
import warnings
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch
from opacus import GradSampleModule, PrivacyEngine
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.data_loader import DPDataLoader
from opacus.optimizers import DPOptimizer
from torch import nn
from torch.utils.data import DataLoader

from fedprivacy.client.sample_dp import DELTA_FACTOR, client_delta, counted_epsilon
from fedprivacy.privacy.accounting import GaussianRound
from fedprivacy.privacy.client_ledgers import event_metrics
from fedprivacy.privacy.noise import torch_seed

RecordAccountant = Literal["rdp", "prv"]


class CountedLoader:
    """Opacus' Poisson loader that counts the batches it has yielded (each may be used by ONE step);
    every other attribute (``dataset``, ``sample_rate``, ...) is the loader's."""

    def __init__(self, loader: DPDataLoader) -> None:
        self.loader = loader
        self.batches = 0

    def __iter__(self) -> Iterator[Any]:
        for batch in self.loader:
            self.batches += 1
            yield batch

    def __len__(self) -> int:
        return len(self.loader)

    def __getattr__(self, name: str) -> Any:
        return getattr(self.loader, name)


@dataclass(frozen=True)
class RecordDP:
    """One client's private training objects for one round (from :func:`make_record_dp`).

    Train with ``module``, ``optimizer`` and ``data_loader`` only (anything else is unaccounted);
    the wrapped model's own parameters are trained in place, so ``model.state_dict()`` of the model
    that was passed in is the reply's weights. As a context manager, its exit removes Opacus' hooks
    and per-record gradients from that model (``GradSampleModule.cleanup``); the accounting stays readable.

    Attributes:
        module: the model wrapped to compute per-record gradients.
        optimizer: Opacus' ``DPOptimizer`` around the given optimizer (clip, noise, step, account).
        data_loader: Poisson batches, each record independently with probability ``q``, counted.
        accountant: Opacus' accountant hooked to ``optimizer``: the steps actually taken.
        population: n, the client's records (privacy units).
        target_delta: δ_i of the reported ε.
    """

    module: GradSampleModule
    optimizer: DPOptimizer
    data_loader: CountedLoader
    accountant: RDPAccountant | PRVAccountant
    population: int
    target_delta: float

    def __enter__(self) -> RecordDP:
        return self

    def __exit__(self, *exc: object) -> None:
        self.module.cleanup()

    @property
    def steps(self) -> int:
        """Private steps taken so far (counted by Opacus' accountant)."""
        return sum(count for *_, count in self.accountant.history)

    @property
    def event(self) -> GaussianRound:
        """One step's release as accounted by Opacus: ``GaussianRound(z, "poisson", n, q n)``.

        Raises:
            ValueError: the accounted steps do not share one ``(z, q)`` (the noise multiplier was changed
                mid-round), or they are not one per batch drawn from ``data_loader`` (module docstring).
        """
        if self.steps != self.data_loader.batches:
            raise ValueError(f"{self.steps} optimizer steps on {self.data_loader.batches} batches drawn from "
                             "RecordDP.data_loader: take exactly one step per batch (a second step on a batch "
                             "releases it again; a step over several batches changes the sampling rate)")
        accounted = {(z, q) for z, q, _ in self.accountant.history} or {
            (self.optimizer.noise_multiplier, self.data_loader.sample_rate)}
        if len(accounted) != 1:
            raise ValueError(f"the round's steps have several (noise_multiplier, sample_rate): {sorted(accounted)}; "
                             "one round must be one event")
        ((z, q),) = accounted
        return GaussianRound(z, "poisson", self.population, q * self.population)

    @property
    def epsilon(self) -> float:
        """ε >= 0 of this round's steps at ``target_delta`` (``inf`` for z = 0, 0 before any step)."""
        return counted_epsilon(self.accountant, self.event, self.target_delta)

    def metrics(self) -> dict[str, float]:
        """The reply metrics the server accounts: :func:`~fedprivacy.privacy.client_ledgers.event_metrics`.

        Raises:
            ValueError: no private step was taken (there is nothing to account, and the server would
                refuse ``steps = 0``).
        """
        if self.steps == 0:
            raise ValueError("no private step was taken: train with RecordDP.optimizer before reading metrics()")
        return event_metrics(self)


def make_record_dp(model: nn.Module, optimizer: torch.optim.Optimizer, data_loader: DataLoader, *,
                   max_grad_norm: float, noise_multiplier: float | None = None,
                   target_epsilon: float | None = None, epochs: float | None = None,
                   target_delta: float | None = None, delta_factor: float = DELTA_FACTOR,
                   accountant: RecordAccountant = "rdp", seed: int | None = None,
                   grad_sample_mode: Literal["hooks", "functorch"] = "hooks") -> RecordDP:
    """Make ``model``, ``optimizer`` and ``data_loader`` record-level private with Opacus (module docstring).

    Args:
        model: any module Opacus can compute per-record gradients for (``grad_sample_mode``).
        optimizer: a ``torch.optim`` optimizer over ``model``'s parameters; the loss given to it must
            be the batch MEAN (Opacus' ``loss_reduction="mean"``).
        data_loader: the client's records, one item per record; its batch size sets the expected batch
            ``B = n / len(data_loader)``; its sampler and generator are not used.
        max_grad_norm: C, the per-record clip norm (flat over all parameters).
        noise_multiplier: z (noise std / C); or give ``target_epsilon`` and ``epochs`` instead.
        target_epsilon: calibrate z with Opacus so ``epochs`` epochs spend this ε at δ_i.
        epochs: the epochs ``target_epsilon`` is for (``int(epochs / q)`` steps).
        target_delta: a fixed δ for every client; default ``delta_factor / n``.
        delta_factor: f of δ_i = f / n, in (0, 1).
        accountant: Opacus' ``"rdp"`` or ``"prv"``.
        seed: reproducible noise and sampling (simulation); None: seeded from the OS's cryptographic source.
        grad_sample_mode: Opacus' per-record gradient engine (``"functorch"`` for layers without hooks).

    Raises:
        ValueError: neither or both of ``noise_multiplier`` and ``target_epsilon``; ``target_epsilon``
            without ``epochs``; an unknown ``accountant``; ``target_delta`` or ``delta_factor`` outside
            (0, 1); an empty data set (the message names the field).
    """
    _check_arguments(noise_multiplier, target_epsilon, epochs, accountant, target_delta)
    population = len(data_loader.dataset)  # type: ignore[arg-type]  # a map-style dataset has a length
    if population == 0:
        raise ValueError("data_loader.dataset is empty: record-level DP needs at least one record")
    delta = client_delta(population, target_delta, delta_factor)
    noise_gen, sampling_gen = _generators(seed, next(model.parameters()).device)
    with warnings.catch_warnings():  # ours is not Opacus' secure_mode, and says why (module docstring)
        warnings.filterwarnings("ignore", message="Secure RNG turned off")
        engine = PrivacyEngine(accountant=accountant)
    common = dict(module=model, optimizer=optimizer, data_loader=data_loader, max_grad_norm=max_grad_norm,
                  noise_generator=noise_gen, grad_sample_mode=grad_sample_mode)
    if target_epsilon is None:
        module, dp_optimizer, _ = engine.make_private(noise_multiplier=noise_multiplier, **common)
    else:
        module, dp_optimizer, _ = engine.make_private_with_epsilon(target_epsilon=target_epsilon,
                                                                   target_delta=delta, epochs=epochs, **common)
    loader = CountedLoader(DPDataLoader.from_data_loader(data_loader, generator=sampling_gen))
    return RecordDP(module, dp_optimizer, loader, engine.accountant, population, delta)


def _check_arguments(noise_multiplier: float | None, target_epsilon: float | None, epochs: float | None,
                     accountant: str, target_delta: float | None) -> None:
    """Refuse, naming the argument, what :func:`make_record_dp` cannot calibrate or account (its "Raises")."""
    if (noise_multiplier is None) == (target_epsilon is None):
        raise ValueError("give exactly one of noise_multiplier and target_epsilon")
    if target_epsilon is not None and epochs is None:
        raise ValueError("target_epsilon needs epochs (the steps it is calibrated for)")
    if accountant not in ("rdp", "prv"):
        raise ValueError(f"accountant must be 'rdp' or 'prv', got {accountant!r}")
    if target_delta is not None and not 0 < target_delta < 1:
        raise ValueError(f"target_delta must be in (0, 1), got {target_delta!r}")


def _generators(seed: int | None, device: torch.device) -> tuple[torch.Generator, torch.Generator]:
    """The noise generator (on ``device``) and the CPU sampling generator: from ``seed``'s two
    ``SeedSequence`` children, or each from ``secrets`` when ``seed`` is None."""
    seeds = ([secrets.randbits(63), secrets.randbits(63)] if seed is None
             else [torch_seed(child) for child in np.random.SeedSequence(seed).spawn(2)])
    return torch.Generator(device=device).manual_seed(seeds[0]), torch.Generator().manual_seed(seeds[1])
