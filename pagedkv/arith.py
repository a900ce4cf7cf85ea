"""Integer arithmetic the whole tree shares: ceiling division.

One function because the tree rounds a division up in many places (blocks for a sequence's tokens,
panels for a matrix's rows, an offset up to an alignment, splits of a context), and an inline
``-(-a // b)`` or ``(a + b - 1) // b`` at each of them is easy to get subtly wrong (``(a + b - 1)``
is not the ceiling for a negative ``a``, ``math.ceil(a / b)`` goes through a float) and hard to
find. Pure arithmetic: no I/O, and torch only for the type checker, so the core imports it as the
kernels do; Triton kernels keep ``tl.cdiv`` / ``triton.cdiv``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, TypeVar

if TYPE_CHECKING:
    from torch import Tensor

# An int, or an integer tensor divided element-wise (a batch's lengths); never a float.
_N = TypeVar("_N", int, "Tensor")


def ceil_div(a: _N, b: int) -> _N:
    """The ceiling of ``a / b``, computed exactly in integers, for any signs of ``a`` and ``b``;
    ``b == 0`` raises. Floor division rounds toward minus infinity, so negating the dividend and
    the result rounds toward plus infinity, with no float involved (exact past 2**53)."""
    return -(-a // b)
