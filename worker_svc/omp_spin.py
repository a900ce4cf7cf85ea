"""How long the OpenMP runtime's idle threads spin before they sleep, for the threads that compute.

Why: after every parallel region, Intel's OpenMP runtime (``libiomp5``, which vLLM's CPU docs and
``bench/vs_vllm.py`` preload for speed) keeps its helper threads spinning for ``KMP_BLOCKTIME``,
200 ms by default, so that the next region starts at once. Inside a forward pass that is what we
want; between two steps it is not: for the few milliseconds of gRPC, protobuf, sampling and the
engine's bookkeeping, a spinning helper holds a core the control plane needs (on a machine with
few cores, a large share of it). vLLM's CPU worker shortens the spin for the same reason, and so
does this (``BLOCKTIME_MS``); ``bench/vs_vllm.py`` workload A ran faster with it
(docs/benchmarks.md, "Measurements behind smaller choices").

The runtime reads ``KMP_BLOCKTIME`` once, at start-up, and torch may have started it before a
worker's code runs (the in-process stack), so this sets it through the runtime's own call,
``kmp_set_blocktime``, which applies to the calling thread's team: ``ModelRunner.step`` calls
``short_spin()`` on whichever thread runs the step (once per thread). An explicit ``KMP_BLOCKTIME``
or ``OMP_WAIT_POLICY`` in the environment wins (then nothing is changed: ``passive`` already sleeps
at once); GNU OpenMP (``libgomp``, torch's own) has no such
call and already sleeps after a short spin, so there this does nothing.
"""

from __future__ import annotations

import ctypes
import threading
from collections.abc import Callable

from pagedkv import envs

BLOCKTIME_MS = 5  # vLLM's choice for its CPU worker: short enough to free the cores between steps

_done = threading.local()
_setter: Callable[[int], object] | None | bool = False  # False: not looked up yet


def _lookup() -> Callable[[int], object] | None:
    """The loaded runtime's ``kmp_set_blocktime`` (libiomp5 / LLVM libomp), or None."""
    if envs.is_set("KMP_BLOCKTIME") or envs.is_set("OMP_WAIT_POLICY"):
        return None
    try:
        fn = ctypes.CDLL(None).kmp_set_blocktime
    except (AttributeError, OSError):
        return None
    fn.argtypes = [ctypes.c_int]
    fn.restype = None
    return fn


def short_spin() -> bool:
    """Set this thread's team to spin ``BLOCKTIME_MS`` (once per thread); True when the runtime
    has the call and the environment does not set ``KMP_BLOCKTIME`` itself."""
    global _setter
    if getattr(_done, "value", None) is not None:
        return bool(_done.value)
    if _setter is False:
        _setter = _lookup()
    setter = _setter if callable(_setter) else None  # looked up above: the call or None
    ok = setter is not None
    if setter is not None:
        setter(BLOCKTIME_MS)
    _done.value = ok
    return ok
