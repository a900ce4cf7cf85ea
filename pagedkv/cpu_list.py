"""CPU lists as Linux writes them (``0-3,8,10-11``): parsed and formatted, one way everywhere."""

from __future__ import annotations

from collections.abc import Iterable


def parse_cpus(spec: str) -> frozenset[int]:
    """'0', '0-3', '0,2,4-5' -> CPU ids. Raises ValueError naming the bad part."""
    cpus: set[int] = set()
    for part in spec.split(","):
        part = part.strip()
        if not part:
            raise ValueError(f"empty item in cpu list {spec!r}")
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f"bad cpu list item {part!r} in {spec!r}: use N, N-M or a comma list of those")
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"bad cpu range {part!r} in {spec!r}: end before start")
        cpus.update(range(a, b + 1))
    return frozenset(cpus)


def format_cpus(cpus: Iterable[int]) -> str:
    """CPU ids -> the shortest list ``parse_cpus`` reads back: {0, 1, 2, 5} -> '0-2,5'."""
    ids = sorted(set(cpus))
    parts: list[str] = []
    i = 0
    while i < len(ids):
        j = i
        while j + 1 < len(ids) and ids[j + 1] == ids[j] + 1:
            j += 1
        parts.append(str(ids[i]) if i == j else f"{ids[i]}-{ids[j]}")
        i = j + 1
    return ",".join(parts)
