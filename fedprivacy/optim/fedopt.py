r"""Adaptive server optimizers (FedAdam, FedYogi, FedAdagrad) on the privatized pseudo-gradient.

Round ``t`` (``t`` = the optimizer's own step count, from 1), Reddi et al. Alg. 2:

.. math::
    m_t &= \beta_1 m_{t-1} + (1-\beta_1)\, g_t \\
    v_t &= v_{t-1} + g_t^2                                                  && \text{(Adagrad)} \\
    v_t &= \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2                            && \text{(Adam)} \\
    v_t &= v_{t-1} - (1-\beta_2)\, g_t^2 \operatorname{sign}(v_{t-1} - g_t^2) && \text{(Yogi)} \\
    x_{t+1} &= x_t + \eta\, \frac{m_t}{\sqrt{v_t} + \tau}

and, with ``bias_correction=True`` (Adam and Yogi only), Kingma & Ba's Alg. 1 form

.. math::
    x_{t+1} = x_t + \eta\, \frac{m_t / (1-\beta_1^t)}{\sqrt{v_t / (1-\beta_2^t)} + \tau}

Symbols: ``lr`` = η, ``beta1`` = β₁, ``beta2`` = β₂, ``tau`` = τ (adaptivity, OUTSIDE the root),
``initial_accumulator`` = v₀; ``g`` = the noised average of client deltas ``Delta_i = x_i - x``,
so the server ADDS the step. Squares, roots and signs are elementwise.

Departures and choices, each deliberate:

* Indexing: Alg. 2 counts rounds from 0 with ``m_{-1}, v_{-1}``; here ``t`` starts at 1 with
  ``m_0 = 0``, ``v_0 = initial_accumulator`` (the same recursion, shifted by one).
* ``v_0``: Alg. 2 asks for ``v_{-1} >= tau^2``, a condition of its convergence analysis. The
  default here is ``v_0 = 0`` (as Flower 1.41's FedAdam/FedYogi/FedAdagrad): τ sits outside the
  root, so the denominator is at least τ > 0 anyway; Adam's bias correction is exact only for
  ``v_0 = 0`` (so it is refused with any other value); and under DP the bias of ``v_t`` is exactly
  ``(1 - beta2^t) * Phi`` only from ``v_0 = 0`` (Tang et al. 2024, arXiv:2312.14334v1, Eq. 2). Pass
  ``initial_accumulator=tau**2`` to meet Alg. 2's condition.
* Bias correction: Alg. 2 has none (``bias_correction=False``, the default). When enabled it uses
  the count ``t`` held in the state, never a round number: Flower 1.41's FedAdam keys it on
  ``server_round + 1`` (t = 2 on its first update) and uses the ``epsilon-hat`` placement
  ``eta * sqrt(1-b2^t)/(1-b1^t) * m / (sqrt(v) + tau)``, i.e. τ is not rescaled; here τ is added
  after the correction, so the first step is ``eta * g / (|g| + tau)`` exactly.
  For Yogi, ``v`` is not an average, so the same factors are a heuristic (Reddi et al.'s released
  Keras Yogi applies them through its step size).
* Adagrad's ``v`` is a running sum, not an average: it has no bias correction, and its momentum
  defaults to ``beta1 = 0`` (plain Adagrad, as Flower's FedAdagrad); Alg. 2 allows any β₁.

State (``count``, ``m``, ``v``) lives in :meth:`state_dict`, so a resumed run continues bit for bit.
``step_`` never mutates or aliases its input ``g`` (the DiSK filter passes its own buffer).

Privacy: POST stage. The input must be the released, already-noised average (invariants 3, 6).

References:
    Reddi et al. 2021, "Adaptive Federated Optimization", arXiv:2003.00295v5, Alg. 2.
    Kingma & Ba 2015, "Adam", arXiv:1412.6980v9, Alg. 1 (bias correction).
    Zaheer et al. 2018, "Adaptive Methods for Nonconvex Optimization" (NeurIPS), Yogi's update.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod

import torch


def adam_second_moment_(v: torch.Tensor, g: torch.Tensor, beta2: float) -> None:
    r"""``v <- beta2 * v + (1 - beta2) * g^2`` in place (Reddi et al. Alg. 2, FedAdam)."""
    v.mul_(beta2).addcmul_(g, g, value=1.0 - beta2)


def yogi_second_moment_(v: torch.Tensor, g: torch.Tensor, beta2: float) -> None:
    r"""``v <- v - (1 - beta2) * g^2 * sign(v - g^2)`` in place (Reddi et al. Alg. 2, FedYogi).

    ``sign(0) = 0``: where ``v == g^2`` exactly, ``v`` stays (a fixed point).
    """
    g2 = g * g
    v.addcmul_(g2, (v - g2).sign_(), value=-(1.0 - beta2))


def adagrad_second_moment_(v: torch.Tensor, g: torch.Tensor) -> None:
    r"""``v <- v + g^2`` in place (Reddi et al. Alg. 2, FedAdagrad)."""
    v.addcmul_(g, g)


def check_decay(name: str, beta: float) -> None:
    """Raise ``ValueError`` naming ``name`` unless the decay rate ``beta`` is in [0, 1)."""
    if not 0.0 <= beta < 1.0:
        raise ValueError(f"{name} must be in [0, 1), got {beta}")


class AdaptiveServerOptimizer(ABC):
    """Shared skeleton: step count, first moment ``m``, a second moment ``v``, and the step.

    Subclasses define how ``v`` absorbs ``g`` (:meth:`_accumulate_`) and the denominator the
    first moment is divided by (:meth:`_denominator`). With ``bias_correction`` the step size is
    ``lr / (1 - beta1^t)``, i.e. the step uses ``m_hat``.

    Args:
        lr: server learning rate η.
        beta1: first-moment decay β₁ in [0, 1).
        bias_correction: divide ``m`` by ``1 - beta1^t`` (subclasses correct ``v`` likewise).
        initial_accumulator: v₀ >= 0, the value every coordinate of ``v`` starts from.

    Raises:
        ValueError: on an out-of-range argument, or a non-zero v₀ with bias correction.
    """

    def __init__(self, lr: float, *, beta1: float, bias_correction: bool, initial_accumulator: float) -> None:
        check_decay("beta1", beta1)
        if initial_accumulator < 0.0:
            raise ValueError(f"initial_accumulator must be >= 0, got {initial_accumulator}")
        if bias_correction and initial_accumulator != 0.0:
            raise ValueError("bias_correction assumes initial_accumulator = 0 (v_0 = 0), "
                             f"got {initial_accumulator}")
        self.lr = lr
        self.beta1 = beta1
        self.bias_correction = bias_correction
        self.initial_accumulator = initial_accumulator
        self.count = 0
        self.m: torch.Tensor | None = None
        self.v: torch.Tensor | None = None

    @abstractmethod
    def _accumulate_(self, v: torch.Tensor, g: torch.Tensor) -> None:
        """Fold ``g`` into the second moment ``v`` in place."""

    @abstractmethod
    def _denominator(self, v: torch.Tensor, t: int) -> torch.Tensor:
        """A NEW tensor the first moment is divided by at step ``t`` (``v`` already updated)."""

    def step_(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        """Update flat ``params`` in place from the released ``pseudo_grad`` (not modified)."""
        if pseudo_grad.shape != params.shape:
            raise ValueError(f"pseudo_grad shape {tuple(pseudo_grad.shape)} != params shape {tuple(params.shape)}")
        if self.m is None or self.v is None:
            self.m = torch.zeros_like(params)
            self.v = torch.full_like(params, self.initial_accumulator)
        self.count += 1
        t = self.count
        self.m.mul_(self.beta1).add_(pseudo_grad, alpha=1.0 - self.beta1)
        self._accumulate_(self.v, pseudo_grad)
        step_size = self.lr / (1.0 - self.beta1**t) if self.bias_correction else self.lr
        params.addcdiv_(self.m, self._denominator(self.v, t), value=step_size)

    def state_dict(self) -> dict:
        """``kind``, ``count`` and copies of ``m`` and ``v`` (None before the first step)."""
        return {
            "kind": type(self).__name__,
            "count": self.count,
            "m": None if self.m is None else self.m.clone(),
            "v": None if self.v is None else self.v.clone(),
        }

    def load_state_dict(self, state: dict) -> None:
        """Restore a :meth:`state_dict` of the same optimizer class (tensors are copied)."""
        if state.get("kind") != type(self).__name__:
            raise ValueError(f"optimizer state of kind {state.get('kind')!r} "
                             f"cannot be loaded into {type(self).__name__}")
        self.count = int(state["count"])
        self.m = None if state["m"] is None else state["m"].clone()
        self.v = None if state["v"] is None else state["v"].clone()


class ServerAdam(AdaptiveServerOptimizer):
    """FedAdam: ``v`` is an EMA of ``g^2``; step ``m / (sqrt(v) + tau)`` (optionally bias-corrected).

    Args:
        lr: server learning rate η.
        beta1: β₁ in [0, 1); Reddi et al. use 0.9.
        beta2: β₂ in [0, 1); Reddi et al. use 0.99.
        tau: adaptivity τ > 0, added outside the root; 1e-3 as Flower 1.41's FedAdam.
        bias_correction: False = Reddi et al. Alg. 2; True = Kingma & Ba Alg. 1 with τ after the
            correction (first step ``lr * g / (|g| + tau)``).
        initial_accumulator: v₀ (see the module docstring); must be 0 with bias correction.
    """

    def __init__(self, lr: float, *, beta1: float = 0.9, beta2: float = 0.99, tau: float = 1e-3,
                 bias_correction: bool = False, initial_accumulator: float = 0.0) -> None:
        super().__init__(lr, beta1=beta1, bias_correction=bias_correction, initial_accumulator=initial_accumulator)
        check_decay("beta2", beta2)
        if not tau > 0.0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.beta2 = beta2
        self.tau = tau

    def _accumulate_(self, v: torch.Tensor, g: torch.Tensor) -> None:
        adam_second_moment_(v, g, self.beta2)

    def _denominator(self, v: torch.Tensor, t: int) -> torch.Tensor:
        root = v.sqrt()  # one temporary: sqrt(v / c) computed as sqrt(v) / sqrt(c)
        if self.bias_correction:
            root.div_(math.sqrt(1.0 - self.beta2**t))
        return root.add_(self.tau)


class ServerYogi(ServerAdam):
    """FedYogi: Adam's step and arguments, with Yogi's additive, sign-controlled ``v`` update.

    ``v`` moves toward ``g^2`` by ``(1 - beta2) * g^2`` per step, whatever the gap ``v - g^2``:
    where ``g^2 << v`` it shrinks additively, not by Adam's factor ``beta2``, so the effective step
    size grows more slowly (Zaheer et al. 2018). Arguments as :class:`ServerAdam`.
    """

    def _accumulate_(self, v: torch.Tensor, g: torch.Tensor) -> None:
        yogi_second_moment_(v, g, self.beta2)


class ServerAdagrad(AdaptiveServerOptimizer):
    """FedAdagrad: ``v`` is the running sum of ``g^2``; step ``m / (sqrt(v) + tau)``.

    Args:
        lr: server learning rate η.
        beta1: momentum β₁ in [0, 1); 0 (default) is plain Adagrad.
        tau: adaptivity τ > 0, added outside the root.
        initial_accumulator: v₀ >= 0.
    """

    def __init__(self, lr: float, *, beta1: float = 0.0, tau: float = 1e-3, initial_accumulator: float = 0.0) -> None:
        # A running sum has no (1 - beta2^t) bias to correct: bias correction is not offered.
        super().__init__(lr, beta1=beta1, bias_correction=False, initial_accumulator=initial_accumulator)
        if not tau > 0.0:
            raise ValueError(f"tau must be > 0, got {tau}")
        self.tau = tau

    def _accumulate_(self, v: torch.Tensor, g: torch.Tensor) -> None:
        adagrad_second_moment_(v, g)

    def _denominator(self, v: torch.Tensor, t: int) -> torch.Tensor:
        return v.sqrt().add_(self.tau)
