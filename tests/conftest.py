"""Suite-wide test setup.

Triton reads TRITON_INTERPRET when its @triton.jit decorators run, so it must
be set before anything imports `kernels`. Without a GPU the Triton kernels run
in the interpreter; code that wants the fast torch reference on CPU selects it
explicitly (see kernels' backend selection).
"""

from __future__ import annotations

import os
import pathlib
import sys

ROOT = pathlib.Path(__file__).resolve().parent.parent
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))


def _has_cuda() -> bool:
    try:
        import torch
    except ImportError:
        return False
    return bool(torch.cuda.is_available())


if not _has_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")


# Services log through structlog; send it to stderr like the real processes do
# (structlog's unconfigured default writes to stdout). Optional: a GPU image without the service
# dependencies (no structlog) must still collect and run tests/kernels.
try:
    import structlog  # noqa: F401
except ImportError:
    structlog = None
if structlog is not None:
    from pagedkv.logging_setup import configure_logging

    configure_logging("info", "console", cache=False)
