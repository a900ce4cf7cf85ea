"""bench/dense_bench.py runs end to end and its derived columns are its own times' arithmetic."""

from __future__ import annotations

import pytest

from pagedkv.kernels.cpu import native as cpu_native
from tests.bench.tables import data_rows, run_bench


@pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built: nothing to compare")
def test_dense_bench_quick() -> None:
    out = run_bench(
        "dense_bench", "--rows", "1,9", "--layers", "2", "--vocab", "100", "--threads", "1", "--reps", "2"
    )
    rows = data_rows(out)
    assert [r[0] for r in rows] == ["1", "9"]
    weights = 2 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536) + 100 * 576
    for n, native_ms, native_gflops, native_gbs, onednn_ms, onednn_gflops, onednn_gbs, ratio in rows:
        for ms, gflops, gbs in (
            (native_ms, native_gflops, native_gbs),
            (onednn_ms, onednn_gflops, onednn_gbs),
        ):
            t = float(ms) / 1e3
            assert abs(float(gflops) - 2 * int(n) * weights / t / 1e9) <= 1 + 0.05 * float(gflops)
            assert abs(float(gbs) - 4 * weights / t / 1e9) <= 0.2 + 0.05 * float(gbs)
        expected = float(onednn_ms) / float(native_ms)
        assert abs(float(ratio.rstrip("x")) - expected) <= 0.02 + 0.05 * expected
