"""Server optimizers, DiSK, DP-MicroAdam, the record-level DP optimizers and AdaDPS (no config, no Flower).
Public (imported on first use): :class:`AdaDPSOptimizer`, AdaDPS's preconditioning around any ``torch.optim``
optimizer."""

from typing import TYPE_CHECKING

from fedprivacy.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from fedprivacy.optim.adadps import AdaDPSOptimizer

__all__ = ["AdaDPSOptimizer"]

__getattr__ = lazy_exports(__name__, {"AdaDPSOptimizer": "fedprivacy.optim.adadps"})
