"""bench/multipool_bench.py --smoke runs end to end: two pools, both policies, the whole table.

The smoke run judges only the hit-rate target (prefix-aware >= 1.5x round-robin): a dozen
requests on a shared machine give no stable TTFT p99, which the full run reports and judges.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_multipool_bench_smoke() -> None:
    # Not the suite's TRITON_INTERPRET=1 (tests/conftest.py): the CPU workers use the torch
    # reference kernels, as in a real CPU run.
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    proc = subprocess.run(
        [sys.executable, "-m", "bench.multipool_bench", "--smoke"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=240,
        check=False,
        env=env,
    )
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    rows = {}
    for policy in ("round-robin", "prefix-aware"):
        m = re.search(
            rf"^{policy}\s+([\d.]+)%\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)\s+\[(.*)\]$",
            proc.stdout,
            re.M,
        )
        assert m, proc.stdout
        rows[policy] = m
        assert 0 < float(m[2]) <= float(m[3])  # TTFT p50 <= p99
        assert sum(int(x) for x in m[6].split(",")) == 12  # every request routed once
    assert float(rows["prefix-aware"][1]) >= 1.5 * float(rows["round-robin"][1])
    assert "smoke target (hit rate >= 1.5x): met" in proc.stdout
