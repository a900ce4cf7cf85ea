"""A role started by a launcher (`pagedkv up`, or any ``Stack``: frontend/launch/processes.py's
``launch``) stops when its launcher is gone.

Why: the roles run in sessions of their own, so that a Ctrl-C meant for `up` reaches only `up`,
which then stops them in order. When `up` itself dies without stopping them (SIGKILL, the OOM
killer, a crashed script that started a stack), nothing else would: they would keep their ports,
their shared memory and their cores. The launcher names itself in ``ENV``; a role started with it
watches its parent and, once the parent is no longer the launcher (it exited, and the role was
re-parented), sends itself SIGTERM: the same orderly stop `up` would have asked for.
"""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Mapping

from pagedkv import envs

ENV = "PAGEDKV_LAUNCHER_PID"
INTERVAL_S = 0.5  # how often the parent is looked at: a role outlives its launcher by about this


def start_from_env(environ: Mapping[str, str] | None = None, interval_s: float = INTERVAL_S) -> bool:
    """Watch the launcher ``ENV`` names, if it is this process's parent (the variable inherited
    from further up, or a launcher already gone, starts nothing); whether a watch started."""
    raw = envs.get_str(ENV, environ)
    if not raw.isdigit() or int(raw) != os.getppid():
        return False
    launcher = int(raw)
    threading.Thread(target=_watch, args=(launcher, interval_s), name="parent-watch", daemon=True).start()
    return True


def _watch(launcher: int, interval_s: float) -> None:
    while os.getppid() == launcher:
        time.sleep(interval_s)
    import structlog  # here: the roles log through it; this module is imported by every command

    structlog.get_logger("pagedkv.parent_watch").warning(
        "launcher_gone", launcher_pid=launcher, action="stop"
    )
    os.kill(os.getpid(), signal.SIGTERM)
