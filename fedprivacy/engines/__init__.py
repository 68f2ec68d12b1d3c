"""Where fedprivacy's apps run: the in-process grid (and its worker processes, and cohorts trained together)
or Flower's Ray engine. Public (imported on first use): :func:`run_inprocess`, which runs any ServerApp and
ClientApp in this process."""

from typing import TYPE_CHECKING

from fedprivacy.lazy_exports import lazy_exports

if TYPE_CHECKING:
    from fedprivacy.engines.inprocess import run_inprocess

__all__ = ["run_inprocess"]

__getattr__ = lazy_exports(__name__, {"run_inprocess": "fedprivacy.engines.inprocess"})
