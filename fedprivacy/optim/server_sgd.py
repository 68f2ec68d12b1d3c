"""Server SGD with heavy-ball momentum on the privatized pseudo-gradient.

.. math:: v_t = \\mu v_{t-1} + g_t, \\qquad x_{t+1} = x_t + \\eta\\, v_t

``g_t`` is the noised average of client deltas (``Delta_i = x_i - x``), so the server ADDS it.
With ``eta = 1, mu = 0`` this is FedAvg's ``x + mean(Delta)``. Privacy: POST stage (post-processing
of the released ``g_t``; invariant 6).

References: Reddi et al. 2021, arXiv:2003.00295v5, Alg. 1 (FedAvgM with ServerOpt = SGDM).
"""

from __future__ import annotations

import torch


class ServerSGD:
    """``x <- x + lr * v`` with ``v <- momentum * v + g``; state = the momentum buffer."""

    def __init__(self, lr: float, momentum: float = 0.0) -> None:
        self.lr = lr
        self.momentum = momentum
        self.velocity: torch.Tensor | None = None

    def step_(self, params: torch.Tensor, pseudo_grad: torch.Tensor) -> None:
        """Update flat ``params`` in place from the released ``pseudo_grad``."""
        if self.momentum:
            if self.velocity is None:
                self.velocity = torch.zeros_like(params)
            direction = self.velocity.mul_(self.momentum).add_(pseudo_grad)
        else:
            direction = pseudo_grad
        params.add_(direction, alpha=self.lr)

    def state_dict(self) -> dict:
        return {"velocity": self.velocity}

    def load_state_dict(self, state: dict) -> None:
        self.velocity = state["velocity"]
