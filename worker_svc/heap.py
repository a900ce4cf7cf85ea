"""Give the C heap's free pages back to the system after loading weights.

Why: loading reads and converts tensors one at a time (dequantizing, requantizing, packing); the
temporaries are freed, but glibc keeps most of that freed heap mapped (its mmap threshold grows
as large blocks are freed, so later ones come from the heap), and the process's resident size
stays hundreds of MB above what it holds. On SmolLM2-135M's GGUF the cache host kept about 225 MB
so; glibc's ``malloc_trim`` (pad 0) returns it. A no-op where the C library has no
``malloc_trim`` (musl, macOS).
"""

from __future__ import annotations

import ctypes
import ctypes.util


def release_free_memory() -> bool:
    """glibc's ``malloc_trim`` (pad 0): True when the C library released memory, False when it
    had none to release or has no such call."""
    name = ctypes.util.find_library("c")
    if name is None:
        return False
    trim = getattr(ctypes.CDLL(name), "malloc_trim", None)
    return bool(trim(0)) if trim is not None else False
