"""The worker's compute threads stop spinning soon after a parallel region when Intel's OpenMP runtime
is loaded (not after its default 200 ms); the environment's KMP_BLOCKTIME wins; GNU OpenMP is left
alone. Spinning is observed as what it costs: process CPU time while the thread sits idle."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

LIBIOMP = Path(sys.prefix) / "lib" / "libiomp5.so"  # the intel-openmp wheel (the worker extra)

PROBE = """
import sys, threading, time
import torch
from pagedkv.worker_svc import omp_spin
torch.set_num_threads(2)
x = torch.randn(1500, 1500)
(x @ x).sum()  # the runtime is up before the worker's code runs (the in-process stack)
time.sleep(0.3)  # and this thread's own helpers have gone to sleep (its default 200 ms)
def probe(out):
    applied = omp_spin.short_spin() if sys.argv[1] == "short" else None
    (x @ x).sum()  # a parallel region on this thread's team, then 200 ms of idling
    c0 = time.process_time(); time.sleep(0.2)
    out.append((applied, round(time.process_time() - c0, 3)))
out = []
t = threading.Thread(target=probe, args=(out,)); t.start(); t.join()
print(out[0])
"""


def _probe(mode: str, env: dict[str, str]) -> tuple[bool | None, float]:
    full = {k: v for k, v in os.environ.items() if k not in ("KMP_BLOCKTIME", "LD_PRELOAD")}
    full.update(env, PYTHONPATH=str(Path(__file__).resolve().parents[2]), OMP_NUM_THREADS="2")
    out = subprocess.run(
        [sys.executable, "-c", PROBE, mode], env=full, capture_output=True, text=True, timeout=120
    )
    assert out.returncode == 0, out.stderr
    return eval(out.stdout.strip().splitlines()[-1])  # type: ignore[no-any-return] # noqa: S307 - our probe's tuple


@pytest.mark.skipif(not LIBIOMP.exists(), reason="intel-openmp is not installed (pip install -e '.[worker]')")
def test_intel_runtime_threads_stop_spinning_soon_unless_the_environment_says_otherwise() -> None:
    iomp = {"LD_PRELOAD": str(LIBIOMP)}
    if os.cpu_count() and os.cpu_count() >= 2:  # a helper thread to spin exists
        _, spun = _probe("default", iomp)
        assert spun > 0.08, spun  # the premise: the runtime's helper spins through the idle time
    applied, spun = _probe("short", iomp)
    assert applied is True and spun < 0.05, spun
    applied, _ = _probe("short", {**iomp, "KMP_BLOCKTIME": "50"})
    assert applied is False  # the operator's setting stands


def test_gnu_openmp_has_no_blocktime_call_and_is_left_alone() -> None:
    applied, _ = _probe("short", {})
    assert applied is False
