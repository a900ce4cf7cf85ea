"""bench/layer_ops_bench.py runs end to end and its ratio column is its own medians' ratio."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from kernels import cpu_layer_ops

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.skipif(not cpu_layer_ops.available(), reason="native kernels not built")
def test_layer_ops_bench_quick() -> None:
    proc = subprocess.run(
        [sys.executable, str(ROOT / "bench" / "layer_ops_bench.py"), "--layers", "2", "--rounds", "2"]
        + ["--batch", "4,2", "--ctx", "40", "--threads", "1"],
        capture_output=True,
        text=True,
        timeout=120,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-2000:]
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and line[2].isdigit()]
    assert [r.split("|")[1].strip() for r in rows] == ["4", "2"]
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        fused_median, torch_median, ratio = float(cells[1]), float(cells[3]), float(cells[5].rstrip("x"))
        assert float(cells[2]) <= fused_median and float(cells[4]) <= torch_median
        assert abs(ratio - torch_median / fused_median) <= 0.01 + 0.01 * ratio
