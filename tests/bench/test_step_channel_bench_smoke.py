"""bench/step_channel_bench.py --quick runs end to end: a worker process, every transport row for 1 and
32 sequences, each with its figures."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_step_channel_bench_quick() -> None:
    proc = subprocess.run(
        [sys.executable, "-m", "bench.step_channel_bench", "--quick"],
        cwd=ROOT, capture_output=True, text=True, timeout=120,
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = re.findall(
        r"^(grpc|shm|shm, 50us spin)\s+(\d+)\s+(\d+)\s+([\d.]+)\s+([\d.]+)\s+([\d.]+)$", proc.stdout, re.M
    )
    assert sorted((r[0], int(r[1])) for r in rows) == sorted(
        (t, n) for t in ("grpc", "shm", "shm, 50us spin") for n in (1, 32)
    ), proc.stdout
    for _, n, size, p50, p99, _mean in rows:
        assert int(size) > (3000 if n == "32" else 50)
        assert 0 < float(p50) <= float(p99)
