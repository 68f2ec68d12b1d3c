r"""Sample-level (record-level) DP optimizers on Opacus: DP-SGD, DP-Adam, DP-AdamBC, AdaDPS, DiSK, DP-MicroAdam.

One step on a Poisson-sampled batch of privacy units (records, or fixed micro-batches of ``k``
records), from Opacus per-sample gradients (``p.grad_sample`` of a ``GradSampleModule``):

.. math::
    \hat g_i &= c\,\nabla f(x_t + \gamma d_{t-1};\ \xi_i) + (1-c)\,\nabla f(x_t;\ \xi_i),
        \qquad c = \frac{1-\kappa}{\kappa\gamma}                              && \text{(DiSK; else } c = 0) \\
    u_j &= \frac{1}{k} \sum_{i \in \text{unit } j} \hat g_i \,/\, A           && (A = 1,\ k = 1 \text{ unless set}) \\
    g_t &= \frac{1}{B}\Big(\sum_j u_j \min\big(1, \tfrac{C}{\lVert u_j\rVert_2}\big)
        + \mathcal N(0, \sigma^2 C^2 I_d)\Big) \\
    \tilde g_t &= (1-\kappa)\,\tilde g_{t-1} + \kappa\, g_t, \quad \tilde g_{-1} = g_0
        && \text{(DiSK; else } \kappa = 1) \\
    x_{t+1} &= \mathrm{BaseOpt}(x_t, \tilde g_t), \qquad d_t = x_{t+1} - x_t

Symbols: σ = ``noise_multiplier``, C = ``max_grad_norm`` (flat L2 over ALL parameters), B =
``expected_batch_size`` (the EXPECTED number of units per step, Opacus' fixed divisor), A =
``preconditioner`` (public, one positive tensor per parameter, broadcast over the batch), k =
``micro_batch_size``, κ, γ = the DiSK filter's gain and lookahead. Every map before the clip is
linear, so the DiSK combination, the division by ``A`` and the micro-batch mean commute.

Methods, as configurations of one mechanism (the base optimizer only post-processes ``g~``):

* DP-SGD (Abadi et al. 2016): base ``torch.optim.SGD``.
* DP-Adam: base ``torch.optim.Adam`` (``m_hat / (sqrt(v_hat) + eps)``), as Opacus users run it.
* DP-AdamBC (arXiv:2312.14334v1, Eq. 4, Alg. 1): :class:`~fedprivacy.optim.adambc.ServerAdamBC`
  with ``Phi = (sigma C / B)^2`` (:func:`~fedprivacy.privacy.placement.dp_noise_variance`), run through
  :class:`FlatDescent`.
* AdaDPS (arXiv:2202.05963v2, Alg. 1 Option 2 with a fixed ``A``): base SGD and ``preconditioner``.
  ``A = 1`` is DP-SGD bit for bit; ``A -> cA`` equals ``C -> cC, lr -> lr/c`` (``clip(u / c, C) =
  clip(u, cC) / c`` and the noise scales with C).
* DiSK (arXiv:2410.03883, Alg. 3): ``disk`` = a :class:`~fedprivacy.optim.disk.DiskFilter`; two
  per-sample passes on the SAME batch (``step`` needs a closure), combined per sample before the
  ONE clip. Opacus sees one batch: ``p.grad_sample`` stays one tensor, so ``accumulated_iterations``
  is 1 and the accountant hook composes exactly one step per DiSK step. Closed-form models pass
  the clipped sum of the combination instead (:meth:`SampleDPOptimizer.step_disk_clipped_sum`).
* DP-MicroAdam (arXiv:2511.20509, Alg. 1): :class:`~fedprivacy.optim.microadam.ServerMicroAdam`
  through :class:`FlatDescent`, on the noised gradient (noise dense, before top-k).

Departures from Opacus' ``DPOptimizer`` (kept: noise via its ``_generate_noise`` with the given
generator, the fixed divisor, the step hook): the clip factor is exactly ``min(1, C/||u||)``, with
no ``+1e-6`` fudge (a zero unit stays zero), and units may be micro-batches.

Micro-batches (AdaDPS App. B: 16 micro-batches of 4): the privacy unit is the micro-batch. Units
are formed once, from a data-independent partition (:class:`~fedprivacy.client.sample_dp.MicroBatchUnits`),
and Poisson-sampled; the sensitivity of the sum to adding or removing one unit is C, so the
accountant sees the Poisson-sampled Gaussian with rate ``q = B / #units`` and multiplier σ, and ε
is for add/remove of one UNIT. The per-coordinate noise on ``g_t`` is σC/B with B counted in
units (4x larger than per-sample DP-SGD's at 16 units of 4: σC/16 against σC/64).

Privacy: MECHANISM stage (per-unit clip, one dense draw of N(0, σ²C²) per parameter tensor from a
dedicated generator); the DiSK filter and every base optimizer see only ``g_t`` (post-processing: the
server's own step, :class:`~fedprivacy.optim.server_step.ServerStep`, with the base optimizer in it).
``A``, γ, κ and ``Phi`` are public.

References:
    Abadi et al. 2016, arXiv:1607.00133v2, Alg. 1 (DP-SGD).
    Yousefpour et al. 2021, arXiv:2109.12298 (Opacus).
    Li, Zaheer, Reddi, Smith 2022, arXiv:2202.05963v2, Alg. 1 and App. B (AdaDPS, micro-batches).
    Tang, Shpilevskiy, Lécuyer 2024, arXiv:2312.14334v1, Eq. (4), Alg. 1 (DP-AdamBC).
    Zhang et al. 2024, arXiv:2410.03883, Alg. 3 (DiSK).
    Hudişteanu, Cyffers, Kalinin 2025, arXiv:2511.20509, Alg. 1 (DP-MicroAdam).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Literal, cast, get_args

import torch
from opacus.optimizers.optimizer import DPOptimizer, _check_processed_flag, _mark_as_processed
from torch.nn.utils import parameters_to_vector, vector_to_parameters
from torch.optim import Optimizer

from fedprivacy.optim.adambc import ServerAdamBC
from fedprivacy.optim.disk import DiskFilter
from fedprivacy.optim.microadam import ServerMicroAdam
from fedprivacy.optim.server_step import ServerStep
from fedprivacy.privacy.placement import dp_noise_variance

BaseName = Literal["sgd", "adam", "adambc", "microadam"]


def clip_factors(norms: torch.Tensor, clip_norm: float) -> torch.Tensor:
    r"""Per-unit flat L2 clip factors :math:`\min(1, C / \lVert u_j \rVert_2)` (1 where the norm is <= C, also at 0)."""
    return torch.where(norms > clip_norm, clip_norm / norms, torch.ones_like(norms))


def _assign_(tensors: Sequence[torch.Tensor], flat: torch.Tensor) -> None:
    """Copy consecutive slices of ``flat`` into ``tensors`` (``parameters_to_vector`` order)."""
    offset = 0
    for t in tensors:
        t.copy_(flat[offset:offset + t.numel()].view_as(t))
        offset += t.numel()


class FlatDescent(Optimizer):
    r"""A flat ``step_(x, pseudo_grad)`` optimizer of :mod:`fedprivacy.optim` as a torch optimizer on gradients.

    The server optimizers ASCEND along a pseudo-gradient (``x <- x + lr * u(g)``). Fed ``-grad``,
    they descend: for Adam-type moments ``m(-g) = -m(g)`` and ``v(-g) = v(g)`` exactly (negation is
    exact in floating point), and DP-MicroAdam treats ``-pseudo_grad`` as its gradient by definition.
    So one implementation of each update serves the server and the sample-level optimizers.

    Args:
        params: the parameters (one group); their order defines the flat vector.
        inner: an object with ``lr``, ``step_(flat_params, flat_pseudo_grad)``, ``state_dict`` and
            ``load_state_dict`` (e.g. :class:`~fedprivacy.optim.adambc.ServerAdamBC`,
            :class:`~fedprivacy.optim.microadam.ServerMicroAdam`).

    ``param_groups[0]["lr"]`` is copied into ``inner.lr`` at each step, so LR schedulers work.
    Parameters without a gradient are treated as having a zero gradient.
    """

    def __init__(self, params, inner) -> None:
        super().__init__(params, {"lr": inner.lr})
        if len(self.param_groups) != 1:
            raise ValueError("FlatDescent supports exactly one parameter group")
        self.inner = inner

    @torch.no_grad()
    def step(self, closure: Callable[[], float] | None = None):
        loss = None
        if closure is not None:
            with torch.enable_grad():
                loss = closure()
        params = self.param_groups[0]["params"]
        self.inner.lr = self.param_groups[0]["lr"]
        x = parameters_to_vector(params)
        grad = torch.cat([(torch.zeros_like(p) if p.grad is None else p.grad).reshape(-1) for p in params])
        self.inner.step_(x, grad.neg_())
        vector_to_parameters(x, params)
        return loss

    def state_dict(self) -> dict:
        return {"lr": self.param_groups[0]["lr"], "inner": self.inner.state_dict()}

    def load_state_dict(self, state_dict: dict) -> None:
        self.param_groups[0]["lr"] = state_dict["lr"]
        self.inner.load_state_dict(state_dict["inner"])


class _GradientStep:
    """A torch optimizer as :class:`~fedprivacy.optim.server_step.ServerStep`'s optimizer.

    ``step_(x, g)`` puts the flat ``g`` (``parameters_to_vector`` order) in the parameters' ``.grad``, takes
    the torch optimizer's step and reads the parameters back into ``x``. Here ``g`` is a gradient (the torch
    optimizer descends) where the server's optimizers ascend a pseudo-gradient; the rest of ServerStep (DiSK's
    filter, linear; its ``V_t``; the record of the move) is the same either way.
    """

    def __init__(self, optimizer: Optimizer, params: list[torch.Tensor]) -> None:
        self.optimizer = optimizer
        self.params = params

    def step_(self, params: torch.Tensor, grad: torch.Tensor) -> None:
        _assign_(cast(list[torch.Tensor], [p.grad for p in self.params]), grad)  # pre_step set every .grad
        self.optimizer.step()
        params.copy_(parameters_to_vector(self.params))

    def set_phi(self, phi: float) -> None:
        """DP-AdamBC's Phi (a :class:`FlatDescent` over :class:`~fedprivacy.optim.adambc.ServerAdamBC`); other
        bases do not subtract the noise variance."""
        inner = getattr(self.optimizer, "inner", None)
        if isinstance(inner, ServerAdamBC):
            inner.set_phi(phi)

    def state_dict(self) -> dict:
        return self.optimizer.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.optimizer.load_state_dict(state)


class SampleDPOptimizer(DPOptimizer):
    """Opacus ``DPOptimizer`` with AdaDPS preconditioning, micro-batch units, an exact clip and DiSK (module docstring).

    Args:
        optimizer: the base optimizer (torch SGD/Adam, or a :class:`FlatDescent`).
        noise_multiplier: σ = noise std / C on the sum of clipped units.
        max_grad_norm: C, the flat L2 clip norm of one unit.
        expected_batch_size: B, the expected number of UNITS per step (the fixed divisor).
        generator: the dedicated noise generator (nothing else may draw from it).
        preconditioner: AdaDPS ``A``: one tensor per parameter (in ``optimizer``'s order),
            broadcastable to it, all entries > 0; ``None`` means A = 1.
        micro_batch_size: k; the batch's rows are consecutive groups of k records, one group per unit.
        disk: a DiSK filter; ``step`` then requires a closure (the two passes re-run it).
        secure_mode: Opacus' floating-point-attack-resistant noise.

    Raises:
        ValueError: on a missing generator, a bad preconditioner or ``micro_batch_size < 1``.
    """

    def __init__(self, optimizer: Optimizer, *, noise_multiplier: float, max_grad_norm: float,
                 expected_batch_size: float, generator: torch.Generator,
                 preconditioner: Sequence[torch.Tensor] | None = None, micro_batch_size: int = 1,
                 disk: DiskFilter | None = None, secure_mode: bool = False) -> None:
        if not isinstance(generator, torch.Generator):
            raise ValueError("SampleDPOptimizer needs a dedicated torch.Generator for the noise")
        if micro_batch_size < 1:
            raise ValueError(f"micro_batch_size must be >= 1, got {micro_batch_size}")
        if not max_grad_norm > 0.0 or noise_multiplier < 0.0 or not expected_batch_size > 0.0:
            raise ValueError("need max_grad_norm > 0, noise_multiplier >= 0 and expected_batch_size > 0")
        super().__init__(optimizer, noise_multiplier=noise_multiplier, max_grad_norm=max_grad_norm,
                         expected_batch_size=expected_batch_size, loss_reduction="mean",
                         generator=generator, secure_mode=secure_mode)
        if preconditioner is not None:
            preconditioner = [torch.as_tensor(a, dtype=p.dtype, device=p.device) for a, p in
                              zip(preconditioner, self.params, strict=True)]
            for a, p in zip(preconditioner, self.params):
                if torch.broadcast_shapes(a.shape, p.shape) != p.shape or not bool((a > 0).all()):
                    raise ValueError(f"preconditioner of shape {tuple(a.shape)} must be positive and "
                                     f"broadcast to its parameter's shape {tuple(p.shape)}")
        self.preconditioner = preconditioner
        self.micro_batch_size = micro_batch_size
        self.post_processing = ServerStep(_GradientStep(optimizer, self.params), disk)
        """What follows the release: DiSK's filter, DP-AdamBC's Phi, the base step (the server's post-processing)."""

    @property
    def disk(self) -> DiskFilter | None:
        return self.post_processing.disk

    def unit_gradients(self) -> list[torch.Tensor]:
        """Per-unit gradients ``u_j`` (before clipping): micro-batch means of ``grad_sample / A``."""
        k = self.micro_batch_size
        units = []
        for i, (p, g) in enumerate(zip(self.params, self.grad_samples)):
            g = g.to(p.dtype)
            if k > 1:
                if g.shape[0] % k:
                    raise ValueError(f"batch of {g.shape[0]} records is not whole micro-batches of {k}")
                g = g.view(g.shape[0] // k, k, *g.shape[1:]).mean(dim=1)
            if self.preconditioner is not None:
                g = g / self.preconditioner[i]
            units.append(g)
        return units

    def clip_and_accumulate(self) -> None:
        """``p.summed_grad += sum_j clip(u_j, C)`` with the exact flat factor :func:`clip_factors`."""
        for p in self.params:
            _check_processed_flag(p.grad_sample)
        units = self.unit_gradients()
        if units[0].shape[0] == 0:  # an empty batch, or a sum loaded by step_clipped_sum: nothing to add
            for p in self.params:
                if p.summed_grad is None:
                    p.summed_grad = torch.zeros_like(p)
                _mark_as_processed(p.grad_sample)
            return
        norms = torch.stack([u.flatten(1).norm(2, dim=1) for u in units], dim=1).norm(2, dim=1)
        factors = clip_factors(norms, self.max_grad_norm)
        for p, u in zip(self.params, units):
            clipped = torch.einsum("i,i...", factors.to(u.dtype), u)
            if p.summed_grad is None:
                p.summed_grad = clipped
            else:  # in place, as Opacus (a 5M-coordinate model would otherwise allocate a sum per step)
                p.summed_grad += clipped
            _mark_as_processed(p.grad_sample)

    def _load_clipped_sum(self, clipped_sum: Sequence[torch.Tensor]) -> None:
        """``p.summed_grad = clipped_sum`` and a ZERO-row ``grad_sample`` per parameter (nothing more to clip)."""
        for p, s in zip(self.params, clipped_sum, strict=True):
            if s.shape != p.shape:
                raise ValueError(f"clipped sum of shape {tuple(s.shape)} for a parameter of shape {tuple(p.shape)}")
            p.summed_grad = s.to(p.dtype)
            p.grad_sample = p.new_zeros((0, *p.shape))

    def step_clipped_sum(self, clipped_sum: Sequence[torch.Tensor]) -> None:
        r"""One step from a clipped sum :math:`\sum_j \min(1, C/\lVert u_j\rVert_2)\, u_j` computed outside Opacus.

        For models whose per-unit gradients are cheaper in closed form than through a
        ``GradSampleModule`` (e.g. exact ghost norms of softmax regression on sparse inputs,
        :func:`~fedprivacy.client.sample_dp.softmax_regression_clipped_sum`). ``clipped_sum`` holds one
        tensor per parameter (this optimizer's order); it becomes ``p.summed_grad`` and every
        parameter gets a ZERO-row ``grad_sample``, so :meth:`step` runs unchanged: nothing more is
        clipped, then the dense noise, the division by B, the accountant hook (one batch) and the
        base step. The caller is responsible for the clip (C, and the units' preconditioning).
        With DiSK use :meth:`step_disk_clipped_sum` (the sum must be of the two-point combination).
        """
        if self.disk is not None:
            raise ValueError("step_clipped_sum takes a one-point sum; with DiSK use step_disk_clipped_sum "
                             "(the two-point combination, clipped once)")
        self._load_clipped_sum(clipped_sum)
        self.step()

    def step_disk_clipped_sum(
            self, combined_clipped_sum: Callable[[list[torch.Tensor] | None, float], Sequence[torch.Tensor]]) -> None:
        r"""One DiSK step (Alg. 3) from a two-point clipped sum computed outside Opacus.

        ``combined_clipped_sum(lookahead, c)`` gets the lookahead point :math:`x_t + \gamma d_{t-1}`
        (one tensor per parameter, this optimizer's order; the parameters themselves stay at
        :math:`x_t`) and :math:`c = (1-\kappa)/(\kappa\gamma)`, and must return, per parameter, the
        clipped sum of the per-unit COMBINATION

        .. math:: \sum_j \min\big(1, C/\lVert \hat u_j \rVert_2\big)\, \hat u_j, \qquad
            \hat u_j = c\, u_j(x_t + \gamma d_{t-1}) + (1-c)\, u_j(x_t)

        on ONE batch (combined before the one clip). ``lookahead`` is None (and ``c`` 0) where one
        pass at :math:`x_t` is the whole update: the first step (``d = 0``) and κ = 1. The rest is
        :meth:`step`'s: dense noise, division by B, ONE accountant step, then ``self.disk`` filters
        :math:`\tilde g_t = (1-\kappa)\tilde g_{t-1} + \kappa g_t`, the base optimizer steps on it and
        the displacement :math:`d_t` is recorded. The filter only post-processes the one release.
        """
        if self.disk is None:
            raise ValueError("step_disk_clipped_sum needs a DiSK filter; without one use step_clipped_sum")
        x = parameters_to_vector(self.params).detach()
        ahead = self.disk.lookahead(x)
        if ahead is None:
            self._load_clipped_sum(combined_clipped_sum(None, 0.0))
        else:
            points = [torch.empty_like(p) for p in self.params]
            _assign_(points, ahead)
            self._load_clipped_sum(combined_clipped_sum(points, self.disk.c))
        if self.pre_step():  # clip (nothing left), noise, divide by B, accountant hook: ONE step
            self._post_process()

    def _two_point_grad_samples(self, closure: Callable[[], float]) -> float:
        """DiSK line 5 before the clip: per-sample ``c g(x + gamma d) + (1 - c) g(x)`` as ONE batch."""
        x = parameters_to_vector(self.params).detach()
        lookahead = self.disk.lookahead(x)
        if lookahead is None:  # first step (d = 0) or kappa = 1: one pass at x
            return closure()
        c = self.disk.c
        with torch.no_grad():
            vector_to_parameters(lookahead, self.params)
        try:
            loss = closure()
            if c == 1.0:  # gamma = (1 - kappa) / kappa: the lookahead alone
                return loss
            ahead = [p.grad_sample for p in self.params]
            for p in self.params:
                p.grad_sample = None  # Opacus would otherwise append a second "batch"
        finally:
            with torch.no_grad():
                vector_to_parameters(x, self.params)
        loss = closure()
        for p, a in zip(self.params, ahead):
            p.grad_sample = c * a + (1.0 - c) * p.grad_sample
        return loss

    def step(self, closure: Callable[[], float] | None = None) -> float | None:
        """Per-sample gradients (from ``closure`` if given), clip, noise, divide, [filter], base step.

        ``closure`` must evaluate the SAME batch each call and call ``backward`` on the summed loss
        (it must not zero or resample anything); DiSK calls it twice. Returns the closure's loss
        (the last pass), or None.
        """
        loss = None
        if self.disk is not None:
            if closure is None:
                raise ValueError("DiSK needs a closure: it re-evaluates the batch at the lookahead")
            with torch.enable_grad():
                loss = self._two_point_grad_samples(closure)
        elif closure is not None:
            with torch.enable_grad():
                loss = closure()
        if self.pre_step():  # clip, noise, divide by B, accountant hook
            self._post_process()
        return loss

    @torch.no_grad()
    def _post_process(self) -> None:
        """:meth:`ServerStep.apply_ <fedprivacy.optim.server_step.ServerStep.apply_>` on the noised ``g_t`` in
        ``p.grad``, whose per-coordinate noise variance is ``Phi = (sigma C / B)^2``: DiSK's filter (if any),
        DP-AdamBC's Phi (``V_t`` under DiSK), the base step, DiSK's record of ``d_t``."""
        self.post_processing.apply_(parameters_to_vector(self.params), torch.cat([p.grad.reshape(-1) for p in self.params]),
                                    dp_noise_variance(self.noise_multiplier, self.max_grad_norm, self.expected_batch_size))


@dataclass(frozen=True)
class SampleDPConfig:
    """Hyperparameters of one sample-level DP optimizer (module docstring for the math).

    Paper methods: DP-SGD = ``base="sgd"``; DP-Adam = ``"adam"``; DP-AdamBC = ``"adambc"``;
    DP-MicroAdam = ``"microadam"`` (float32 parameters, as the server version); AdaDPS = ``"sgd"`` plus a preconditioner (passed to
    :func:`make_sample_dp_optimizer`, not a hyperparameter); DiSK = any base with ``disk_kappa < 1``.

    Attributes:
        base: the base optimizer.
        lr: its learning rate.
        noise_multiplier: σ.
        clip_norm: C (per unit).
        batch_size: expected RECORDS per step (Poisson: ``q = batch_size / n``).
        micro_batch_size: k records per privacy unit (1 = per-sample clipping; AdaDPS used 4).
        momentum: SGD heavy-ball momentum (no dampening).
        beta1, beta2: Adam-type decays.
        eps: Adam's and MicroAdam's ε, outside the square root.
        gamma_prime: DP-AdamBC's γ′ (inside the root; replaces ``eps``).
        density, ring_size, bucket_size, stochastic_rounding, per_tensor_topk: DP-MicroAdam's
            k/d, window m, quantisation bucket, rounding and top-k per parameter tensor (paper code).
        disk_kappa: DiSK gain κ in (0, 1]; 1 switches DiSK off.
        disk_gamma: DiSK lookahead γ != 0 (the paper's experiments: κ = 0.7, γ = 0.5).
    """

    base: BaseName = "sgd"
    lr: float = 0.1
    noise_multiplier: float = 1.0
    clip_norm: float = 1.0
    batch_size: float = 64.0
    micro_batch_size: int = 1
    momentum: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.999
    eps: float = 1e-8
    gamma_prime: float = 1e-8
    density: float = 0.01
    ring_size: int = 10
    bucket_size: int = 100_000
    stochastic_rounding: bool = False
    per_tensor_topk: bool = True
    disk_kappa: float = 1.0
    disk_gamma: float = 0.5

    def __post_init__(self) -> None:
        if self.base not in get_args(BaseName):
            raise ValueError(f"SampleDPConfig.base must be one of {get_args(BaseName)}, got {self.base!r}")
        if not self.batch_size > 0 or self.micro_batch_size < 1 or self.batch_size < self.micro_batch_size:
            raise ValueError("SampleDPConfig needs batch_size >= micro_batch_size >= 1, "
                             f"got {self.batch_size}, {self.micro_batch_size}")
        if not 0.0 < self.disk_kappa <= 1.0 or self.disk_gamma == 0.0:
            raise ValueError(f"SampleDPConfig needs disk_kappa in (0, 1] and disk_gamma != 0, "
                             f"got {self.disk_kappa}, {self.disk_gamma}")

    @property
    def expected_units(self) -> float:
        """B: expected privacy units per step, ``batch_size / micro_batch_size`` (the fixed divisor)."""
        return self.batch_size / self.micro_batch_size

    @property
    def phi(self) -> float:
        """DP-AdamBC's ``Phi = (sigma C / B)^2``, B in units: the noise variance per coordinate of ``g_t``."""
        return dp_noise_variance(self.noise_multiplier, self.clip_norm, self.expected_units)


def make_base_optimizer(params: Sequence[torch.nn.Parameter], cfg: SampleDPConfig, *, seed: int = 0) -> Optimizer:
    """The base optimizer named by ``cfg.base`` over ``params`` (``seed``: MicroAdam's rounding stream)."""
    params = list(params)
    if cfg.base == "sgd":
        return torch.optim.SGD(params, lr=cfg.lr, momentum=cfg.momentum)
    if cfg.base == "adam":
        return torch.optim.Adam(params, lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    if cfg.base == "adambc":
        return FlatDescent(params, ServerAdamBC(cfg.lr, phi=cfg.phi, gamma_prime=cfg.gamma_prime,
                                                beta1=cfg.beta1, beta2=cfg.beta2))
    sizes = [p.numel() for p in params] if cfg.per_tensor_topk else None
    return FlatDescent(params, ServerMicroAdam(
        lr=cfg.lr, beta1=cfg.beta1, beta2=cfg.beta2, eps=cfg.eps, density=cfg.density,
        ring_size=cfg.ring_size, bucket_size=cfg.bucket_size, stochastic_rounding=cfg.stochastic_rounding,
        per_tensor_sizes=sizes, seed=seed, device=params[0].device))


def make_sample_dp_optimizer(params: Sequence[torch.nn.Parameter], cfg: SampleDPConfig, *,
                             generator: torch.Generator, preconditioner: Sequence[torch.Tensor] | None = None,
                             seed: int = 0, secure_mode: bool = False) -> SampleDPOptimizer:
    """A :class:`SampleDPOptimizer` for ``cfg`` over the parameters of a ``GradSampleModule``.

    Args:
        params: the trainable parameters, in the order ``preconditioner`` follows.
        cfg: hyperparameters.
        generator: the dedicated noise generator.
        preconditioner: AdaDPS ``A`` (public), or None.
        seed: seeds DP-MicroAdam's stochastic-rounding generator (unused otherwise).
        secure_mode: Opacus' secure noise.
    """
    params = list(params)
    disk = DiskFilter(cfg.disk_kappa, cfg.disk_gamma) if cfg.disk_kappa < 1.0 else None
    return SampleDPOptimizer(make_base_optimizer(params, cfg, seed=seed), noise_multiplier=cfg.noise_multiplier,
                             max_grad_norm=cfg.clip_norm, expected_batch_size=cfg.expected_units,
                             generator=generator, preconditioner=preconditioner,
                             micro_batch_size=cfg.micro_batch_size, disk=disk, secure_mode=secure_mode)
