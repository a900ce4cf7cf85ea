"""Implementations registered by name, each a module imported on first use.

The one way the project selects an implementation by name: kernel backends (``kernels/backend.py``)
and model architectures (``worker_svc/model/registry.py``) each keep a ``name -> module`` table and
load through ``load``. Lazy import keeps optional dependencies (Triton) and heavy modules out of a
process until their name is chosen.
"""

from __future__ import annotations

import importlib
from collections.abc import Mapping
from types import ModuleType


def load(table: Mapping[str, str], name: str, what: str) -> ModuleType:
    """The module registered as ``name`` in ``table``; ``ValueError`` naming ``what`` and the choices."""
    try:
        module = table[name]
    except KeyError:
        raise ValueError(f"unknown {what} {name!r}; registered: {sorted(table)}") from None
    return importlib.import_module(module)
