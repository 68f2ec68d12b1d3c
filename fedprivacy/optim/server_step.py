r"""The server's post-processing of a released ``g_t``: DiSK's filter (optional), then the optimizer.

Shared by fedprivacy's server (:class:`fedprivacy.fl.server_app.DPFedAvgServer`), the Flower
strategy (:class:`fedprivacy.fl.strategy.DPFedAvg`) and the record-level optimizers
(:class:`fedprivacy.optim.sample_dp.SampleDPOptimizer`, on each step's noised gradient), so all run exactly
this step (invariant 6: it sees the released ``g_t`` and public constants only, so it costs no privacy):

.. math::
    \tilde g_t &= (1-\kappa)\,\tilde g_{t-1} + \kappa\, g_t, \qquad
    V_t = (1-\kappa)^2 V_{t-1} + \kappa^2 \Phi_t \qquad \text{(DiSK, if configured)} \\
    x_{t+1} &= \mathrm{ServerOpt}(x_t, \tilde g_t), \qquad d_t = x_{t+1} - x_t

(Zhang et al. 2024, arXiv:2410.03883, Alg. 3; :mod:`fedprivacy.optim.disk`). Without DiSK,
``g~ = g`` and ``V_t = Phi_t``. DP-FedAdamBC (Tang et al. 2024, Eq. 4; :mod:`fedprivacy.optim.adambc`)
subtracts the noise variance of what it is fed: ``Phi_t`` for ``g_t``, the filter's ``V_t`` under DiSK; it
is told through ``set_phi``, which any optimizer that subtracts it has.
"""

from __future__ import annotations

from typing import Any

import torch

from fedprivacy.optim.disk import DiskFilter
from fedprivacy.optim.factory import ServerOptimizer


class ServerStep:
    """DiSK's filter if ``disk`` is given, DP-FedAdamBC's Phi, the optimizer step, DiSK's record of it.

    Args:
        optimizer: any server optimizer (:func:`fedprivacy.optim.factory.make_server_optimizer`); one with
            ``set_phi(phi)`` (:class:`~fedprivacy.optim.adambc.ServerAdamBC`) is told the noise variance first.
        disk: the DiSK filter, or None for the optimizer alone.
    """

    def __init__(self, optimizer: ServerOptimizer, disk: DiskFilter | None = None) -> None:
        self.optimizer = optimizer
        self.disk = disk

    def lookahead(self, params: torch.Tensor) -> torch.Tensor | None:
        """DiSK's ``x_t + gamma d_{t-1}`` for the clients' second pass, or None when one pass is the update."""
        return self.disk.lookahead(params) if self.disk is not None else None

    def apply_(self, params: torch.Tensor, g: torch.Tensor, phi: float) -> None:
        """``params <- ServerOpt(params, g~)`` in place, ``phi`` being ``Phi_t``, the per-coordinate noise
        variance of ``g`` (:meth:`fedprivacy.privacy.mechanism.GaussianMechanism.phi`)."""
        if self.disk is not None:
            g = self.disk.filter_(g, phi)
            phi = self.disk.noise_variance
        set_phi = getattr(self.optimizer, "set_phi", None)  # DP-FedAdamBC subtracts phi
        if set_phi is not None:
            set_phi(phi)
        if self.disk is None:
            self.optimizer.step_(params, g)
            return
        before = params.clone()
        self.optimizer.step_(params, g)
        self.disk.record_(params - before)

    def state_dict(self) -> dict[str, Any]:
        """``{"optimizer": ..., "disk": ... or None}`` (the keys of the server's checkpoint)."""
        return {"optimizer": self.optimizer.state_dict(),
                "disk": self.disk.state_dict() if self.disk is not None else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.optimizer.load_state_dict(state["optimizer"])
        if self.disk is not None:
            self.disk.load_state_dict(state["disk"])
