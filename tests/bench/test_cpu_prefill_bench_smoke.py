"""bench/cpu_prefill_bench.py runs end to end (its outputs agree, it checks that first) and its ratio
columns are its own times' arithmetic."""

from __future__ import annotations

import pytest

from pagedkv.kernels.cpu import native as cpu_native
from tests.bench.tables import data_rows, run_bench


@pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built: nothing to compare")
def test_cpu_prefill_bench_quick() -> None:
    out = run_bench("cpu_prefill_bench", "--threads", "1", "--reps", "1", "--layers", "1", "--shapes", "2")
    rows = data_rows(out)
    assert [r[1] for r in rows] == ["20 x 24", "10 x 48"]
    for row in rows:
        kernel, per_row, buckets = (float(c) for c in row[3:6])
        assert abs(float(row[6].rstrip("x")) - per_row / kernel) <= 0.01 + 0.01 * per_row / kernel
        assert abs(float(row[7].rstrip("x")) - buckets / kernel) <= 0.01 + 0.01 * buckets / kernel


@pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built: nothing to compare")
def test_cpu_prefill_bench_long_shapes() -> None:
    out = run_bench(
        "cpu_prefill_bench", "--long", "--threads", "1", "--reps", "1", "--layers", "1", "--shapes", "1"
    )
    assert [(r[0], r[1], r[2]) for r in data_rows(out)] == [("32/8 x 64", "1 x 256", "4000")]
