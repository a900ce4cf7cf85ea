"""bench/layer_ops_bench.py runs end to end and its ratio column is its own medians' ratio."""

from __future__ import annotations

import pytest

from pagedkv.kernels.cpu import layer_ops as cpu_layer_ops
from tests.bench.tables import data_rows, run_bench


@pytest.mark.skipif(not cpu_layer_ops.available(), reason="native kernels not built")
def test_layer_ops_bench_quick() -> None:
    out = run_bench(
        "layer_ops_bench",
        "--layers",
        "2",
        "--rounds",
        "2",
        "--batch",
        "4,2",
        "--ctx",
        "40",
        "--threads",
        "1",
    )
    rows = data_rows(out)
    assert [r[0] for r in rows] == ["4", "2"]
    for cells in rows:
        fused_median, torch_median, ratio = float(cells[1]), float(cells[3]), float(cells[5].rstrip("x"))
        assert float(cells[2]) <= fused_median and float(cells[4]) <= torch_median
        assert abs(ratio - torch_median / fused_median) <= 0.01 + 0.01 * ratio
