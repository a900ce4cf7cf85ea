"""Rate-limited log lines for events a client can cause at will (rejected, malformed, unauthenticated calls).

Why: one info line per rejected request lets a misbehaving client flood the log (and the disk). Each
server keeps one :class:`LogLimiter`; per event name it lets ``burst`` lines through per ``window_s``
and counts the rest. The next line of that event that gets through carries ``suppressed=N``: how
many lines of the same event were dropped since the previous one, so the volume is still visible.
Metrics (docs/observability.md) count every rejection regardless.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from typing import Any

DEFAULT_BURST = 20
DEFAULT_WINDOW_S = 10.0


class LogLimiter:
    def __init__(
        self,
        burst: int = DEFAULT_BURST,
        window_s: float = DEFAULT_WINDOW_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.burst = burst
        self.window_s = window_s
        self._clock = clock
        self._lock = threading.Lock()
        self._state: dict[str, list[float]] = {}  # event -> [window start, lines in window, suppressed]

    def admit(self, event: str) -> int | None:
        """None when this line is to be dropped; else the number of lines dropped before it."""
        now = self._clock()
        with self._lock:
            st = self._state.get(event)
            if st is None or now - st[0] >= self.window_s:
                suppressed = int(st[2]) if st is not None else 0
                self._state[event] = [now, 1, 0]
                return suppressed
            if st[1] < self.burst:
                st[1] += 1
                suppressed, st[2] = int(st[2]), 0
                return suppressed
            st[2] += 1
            return None

    def info(self, logger: Any, event: str, **fields: Any) -> None:
        """``logger.info(event, **fields)`` unless over the limit (then only counted)."""
        suppressed = self.admit(event)
        if suppressed is None:
            return
        if suppressed:
            fields["suppressed"] = suppressed
        logger.info(event, **fields)
