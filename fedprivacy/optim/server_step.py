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

The strategy asks the step, never its parts, for what they add around the release, each through one optional
hook of the parts (the filter, the optimizer): ``broadcast(params)`` (records added to the next round's broadcast,
:class:`~fedprivacy.optim.broadcast.StepBroadcast`: DiSK's lookahead), ``downlink_bytes()`` (the optimizer's
sparse ``x_t - x_{t-1}``: DP-MicroAdam's) and ``metrics()`` (the round's diagnostics: DP-FedAdamBC's floored
fraction). So a part of one's own that needs Phi_t (``set_phi``) or sends something to the clients plugs in with
no edit of the strategy.
"""

from __future__ import annotations

from typing import Any

import torch

from fedprivacy.optim.broadcast import StepBroadcast
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

    def broadcast(self, params: torch.Tensor) -> StepBroadcast:
        """What the filter and the optimizer add to the broadcast of ``x_t`` (``params``) through their
        ``broadcast(params)`` hook (module docstring), merged; nothing when neither has one."""
        merged = StepBroadcast()
        for part in (self.disk, self.optimizer):
            hook = getattr(part, "broadcast", None)
            if hook is not None:
                merged.merge(hook(params), part)
        return merged

    def downlink_bytes(self, params: torch.Tensor, t: int, extra: StepBroadcast) -> int:
        """The bytes each sampled node receives in round ``t``: the model (float32; from round 2 the optimizer's
        sparse change when it has ``downlink_bytes()``) and ``extra``'s arrays (float32, the model's size)."""
        sparse = getattr(self.optimizer, "downlink_bytes", None)  # DP-MicroAdam: x_t - x_{t-1} is sparse
        model_bytes = sparse() if sparse is not None and t > 1 else 4 * params.numel()
        return model_bytes + sum(4 * array.numel() for array in extra.arrays.values())

    def metrics(self) -> dict[str, float]:
        """The optimizer's diagnostics of its last step (its ``metrics()`` hook), or none."""
        hook = getattr(self.optimizer, "metrics", None)
        return {} if hook is None else dict(hook())

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
