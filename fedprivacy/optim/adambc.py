r"""DP-FedAdamBC: server Adam with the known DP bias ``Phi`` removed from the second moment.

The noised average ``g_t = (sum_i clip(Delta_i) + N(0, z^2 C^2 I)) / m`` carries per-coordinate noise
of variance ``Phi``; squared, that noise adds ``Phi`` to the bias-corrected second moment in
expectation, so plain DP-Adam divides by ``sqrt(v_hat_clean + Phi)`` and, when ``Phi`` dominates,
behaves like SGD with momentum (Tang et al. 2024, arXiv:2312.14334v1, §3, Eq. 3). With ``m_0 = v_0 = 0``:

.. math::
    \Phi &= \Big(\frac{z\,C}{m}\Big)^2, \qquad
    m_t = \beta_1 m_{t-1} + (1-\beta_1)\, g_t, \qquad
    v_t = \beta_2 v_{t-1} + (1-\beta_2)\, g_t^2 \\
    \hat m_t &= \frac{m_t}{1-\beta_1^t}, \qquad \hat v_t = \frac{v_t}{1-\beta_2^t}, \qquad
    \mathbb E[\hat v_t] = \hat v_t^{\,c} + \Phi, \qquad
    \mathbb E[v_t] = v_t^{\,c} + (1-\beta_2^t)\,\Phi \\
    x_{t+1} &= x_t + \eta\, \frac{\hat m_t}{\sqrt{\max(\hat v_t - \Phi,\ \gamma')}}
        && \text{(corrected\_v = True: paper Eq. 4)} \\
    x_{t+1} &= x_t + \eta\, \frac{m_t}{\sqrt{\max\big(v_t - (1-\beta_2^t)\Phi,\ \gamma'\big)}}
        && \text{(corrected\_v = False)}

Symbols: ``lr`` = η, ``beta1`` = β₁, ``beta2`` = β₂, ``gamma_prime`` = γ′, ``phi`` = Φ (from
:func:`~fedprivacy.privacy.placement.dp_noise_variance`: ``noise_multiplier`` = z, ``clip_norm`` = C,
``expected_cohort`` = m);
``t`` = the optimizer's own step count (from 1, held in the state); ``v^c`` = the moment the clean
(un-noised) averages would give. All operations are elementwise. Order: bias-correct, subtract
Φ, ``max(., gamma')``, square root, divide; there is NO additive epsilon (γ′ replaces Adam's γ, and
the denominator's floor is ``sqrt(gamma')``).

Departures from the paper, each deliberate:

* The paper is central DP-SGD (examples, batch ``B``, ``Phi = (sigma C / B)^2``) and has no
  federated setting. Here clients replace examples and ``m`` is the EXPECTED cohort, the fixed
  divisor of the mechanism, so ``Phi = (z C / m)^2`` is constant and public (the paper's Eq. 2 with
  clients in place of examples; not in the paper).
* Sign: the paper descends ``theta - eta * Delta`` on gradients; here ``g`` is an average of
  model deltas ``x_i - x``, so the server ADDS the step.
* ``corrected_v=False`` is not in the paper: it is Reddi et al.'s un-corrected FedAdam moments
  (neither ``m`` nor ``v`` divided by ``1 - beta^t``), whose noise bias is ``(1 - beta2^t) Phi``
  (the paper's Eq. 2, before its bias correction). γ′ then floors the raw, un-corrected scale.
* γ′ is constant. The authors' code has a ``gamma_decay`` option and App. G suggests a
  decreasing schedule; neither is implemented.

Time-varying noise: when the per-round variance :math:`\Phi_t` changes (adaptive clipping moves
C_t; heterogeneous rounds), the bias of ``v`` is the same EMA of the :math:`\Phi_\tau` that ``v`` is
of the :math:`g_\tau^2`: :math:`\bar\Phi_t = \beta_2 \bar\Phi_{t-1} + (1-\beta_2)\Phi_t`,
:math:`\bar\Phi_0 = 0`; the corrected update subtracts :math:`\bar\Phi_t / (1-\beta_2^t)`, the
un-corrected one :math:`\bar\Phi_t` (Eq. 2 of the paper with a per-step Φ; its Φ is constant). Set the round's
value with :meth:`ServerAdamBC.set_phi` before its step. For a constant Φ this is exactly the
formulas above (:math:`\bar\Phi_t = (1-\beta_2^t)\Phi`). A divisor equal to the REALIZED cohort,
the other source of a time-varying Φ, is refused by this pipeline on privacy grounds
(invariant 2: the divisor is the fixed expected cohort). Noise placements set Φ through
:func:`fedprivacy.privacy.placement.released_noise_variance` (local noise: :math:`z^2C^2/m`).

Under DiSK the optimizer is fed the FILTERED gradient, whose noise variance is the filter's
:math:`V_t` (about ``0.54 Phi`` at ``kappa = 0.7``; :mod:`fedprivacy.optim.disk`), not Phi: the server
and the record-level optimizer pass ``V_t`` to :meth:`ServerAdamBC.set_phi` each step, so the same
EMA bias identity holds for the filtered stream.

Precision: ``v_hat - Phi`` is a difference of nearly equal numbers when noise dominates; state
has the dtype of ``params`` and must be float32 or wider (float16's smallest normal is 6e-5 and bfloat16
resolves about 4e-3 of a value: both destroy it).

Privacy: POST stage. ``Phi`` and γ′ are public (config only, never estimated from data); the
moments see only the released ``g_t`` (invariants 3, 6), so ε is that of DP-FedAvg.

References:
    Tang, Shpilevskiy & Lécuyer 2024, "DP-AdamBC: Your DP-Adam Is Actually DP-SGD (Unless You
    Apply Bias Correction)", AAAI; arXiv:2312.14334v1, Eq. (2) (bias), Eq. (4) and Alg. 1 (update).
    Reddi et al. 2021, arXiv:2003.00295v5, Alg. 2 (server Adam on pseudo-gradients).
    Kingma & Ba 2015, arXiv:1412.6980v9, Alg. 1 (bias correction).
"""

from __future__ import annotations

import torch

from fedprivacy.optim.fedopt import AdaptiveServerOptimizer, adam_second_moment_, check_decay


class ServerAdamBC(AdaptiveServerOptimizer):
    """Server Adam with the DP bias Φ subtracted from the second moment (module docstring).

    Args:
        lr: server learning rate η.
        phi: Φ >= 0 from :func:`~fedprivacy.privacy.placement.dp_noise_variance`; 0 gives Adam with γ′
            inside the root.
        gamma_prime: γ′ > 0, the floor under ``v_hat - Phi``; tune it relative to Φ (the paper's
            tuned values span about 0.004 Φ to 0.84 Φ, App. A) and jointly with ``lr``.
        beta1: β₁ in [0, 1).
        beta2: β₂ in [0, 1); 0.999 as in the paper's experiments.
        corrected_v: True = paper Eq. (4) on bias-corrected moments; False = un-corrected
            moments with ``(1 - beta2^t) * Phi`` subtracted.

    Raises:
        ValueError: on an out-of-range argument.
    """

    def __init__(self, lr: float, *, phi: float, gamma_prime: float, beta1: float = 0.9, beta2: float = 0.999,
                 corrected_v: bool = True) -> None:
        # v_0 = 0 always: Eq. (2)'s bias (1 - beta2^t) Phi, and Adam's bias correction, assume it.
        super().__init__(lr, beta1=beta1, bias_correction=corrected_v, initial_accumulator=0.0)
        check_decay("beta2", beta2)
        if phi < 0.0:
            raise ValueError(f"phi must be >= 0, got {phi}")
        if not gamma_prime > 0.0:
            raise ValueError(f"gamma_prime must be > 0, got {gamma_prime}")
        self.beta2 = beta2
        self.phi = phi
        self.phi_ema = 0.0  # Phi-bar_t, the EMA of the per-round Phi_t (module docstring)
        self.gamma_prime = gamma_prime
        self.corrected_v = corrected_v
        self.floored_fraction = float("nan")  # share of coordinates whose v_hat - Phi hit gamma' at the last step

    def set_phi(self, phi: float) -> None:
        """Φ_t of the NEXT step's ``g`` (public: from the mechanism's parameters only)."""
        if phi < 0.0:
            raise ValueError(f"phi must be >= 0, got {phi}")
        self.phi = phi

    def metrics(self) -> dict[str, float]:
        """``adambc_floored_fraction``: the share of coordinates whose ``v_hat - Phi`` hit γ′ at the last step
        (where bias correction can matter; Tang et al., arXiv:2312.14334v1, §4)."""
        return {"adambc_floored_fraction": self.floored_fraction}

    def _accumulate_(self, v: torch.Tensor, g: torch.Tensor) -> None:
        adam_second_moment_(v, g, self.beta2)
        self.phi_ema = self.beta2 * self.phi_ema + (1.0 - self.beta2) * self.phi

    def _denominator(self, v: torch.Tensor, t: int) -> torch.Tensor:
        if self.corrected_v:
            correction = 1.0 - self.beta2**t
            shifted = (v / correction).sub_(self.phi_ema / correction)
        else:
            shifted = v - self.phi_ema
        floored = shifted < self.gamma_prime
        self.floored_fraction = floored.sum().item() / max(floored.numel(), 1)
        return shifted.clamp_(min=self.gamma_prime).sqrt_()

    def state_dict(self) -> dict:
        return {**super().state_dict(), "phi": self.phi, "phi_ema": self.phi_ema}

    def load_state_dict(self, state: dict) -> None:
        super().load_state_dict(state)
        if "phi_ema" in state:
            self.phi, self.phi_ema = float(state["phi"]), float(state["phi_ema"])
        else:  # a checkpoint from before per-round Phi: Phi was constant, so Phi-bar_t = (1 - beta2^t) Phi
            self.phi_ema = (1.0 - self.beta2**self.count) * self.phi
