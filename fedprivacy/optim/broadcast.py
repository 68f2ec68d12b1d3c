"""What a server step's part adds to the next round's broadcast (:meth:`fedprivacy.optim.server_step.ServerStep.broadcast`).

A part of the server step (DiSK's filter, the optimizer, a step of one's own) may have ``broadcast(params)``: it
returns a :class:`StepBroadcast` computed from ``x_t`` and its own state, both functions of released values only
(invariant 9), so sending it costs no privacy. DiSK's (Zhang et al. 2024, arXiv:2410.03883, Alg. 3, line 3) is the
lookahead point :math:`x_t + \\gamma d_{t-1}` and ``disk-c`` :math:`= (1-\\kappa)/(\\kappa\\gamma)`.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch


@dataclass
class StepBroadcast:
    """Records a server step's part adds to every train message of a round."""

    arrays: dict[str, torch.Tensor] = field(default_factory=dict)
    """Flat tensors of the model's size, each sent as a record of the model's layout under its name."""
    config: dict[str, int | float | str] = field(default_factory=dict)
    """Keys added to the round's ``config``."""

    def merge(self, other: StepBroadcast, part: object) -> None:
        """Add ``other`` (from ``part``); a name two parts both send is refused naming it."""
        clash = sorted((set(self.arrays) & set(other.arrays)) | (set(self.config) & set(other.config)))
        if clash:
            raise ValueError(f"{type(part).__name__} adds {clash[0]!r} to the broadcast, which another part of the "
                             "server step already sends")
        self.arrays.update(other.arrays)
        self.config.update(other.config)
