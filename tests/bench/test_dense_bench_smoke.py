"""bench/dense_bench.py runs end to end and its derived columns are its own times' arithmetic."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_dense_bench_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "dense_bench.py"), "--rows", "1,4", "--layers", "2"]
        + ["--threads", "1", "--reps", "2"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["1", "4"]
    weights = 2 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        n, cold_ms, cold_gflops, cold_gbs, hot_ms, hot_gflops, ratio = cells
        c, h = float(cold_ms) / 1e3, float(hot_ms) / 1e3
        assert abs(float(cold_gflops) - 2 * int(n) * weights / c / 1e9) <= 1 + 0.05 * float(cold_gflops)
        assert abs(float(cold_gbs) - 4 * weights / c / 1e9) <= 0.2 + 0.05 * float(cold_gbs)
        assert abs(float(hot_gflops) - 2 * int(n) * weights / h / 1e9) <= 1 + 0.05 * float(hot_gflops)
        assert abs(float(ratio.rstrip("x")) - c / h) <= 0.02 + 0.05 * c / h
