"""Re-exports for the packages' ``__init__`` files, imported on first use (PEP 562 module ``__getattr__``).

``from fedprivacy import DPFedAvg`` imports :mod:`fedprivacy.fl.strategy` then, not before: importing any
fedprivacy module runs ``fedprivacy/__init__.py`` first, and the core must not pull in Flower, Opacus and
the accountants with it.
"""

from __future__ import annotations

import importlib
import sys
from collections.abc import Callable, Mapping


def lazy_exports(package: str, exports: Mapping[str, str]) -> Callable[[str], object]:
    """The module ``__getattr__`` of ``package``: each name of ``exports`` (name -> the module that defines it)
    is imported from its module when first asked for, then kept in the package's namespace."""

    def __getattr__(name: str) -> object:
        if name not in exports:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(exports[name]), name)
        setattr(sys.modules[package], name, value)
        return value

    return __getattr__
