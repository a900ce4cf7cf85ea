"""bench/dense_bench.py runs end to end and its derived columns are its own times' arithmetic."""

from __future__ import annotations

from tests.bench.tables import data_rows, run_bench


def test_dense_bench_quick() -> None:
    out = run_bench("dense_bench.py", "--rows", "1,4", "--layers", "2", "--threads", "1", "--reps", "2")
    rows = data_rows(out)
    assert [r[0] for r in rows] == ["1", "4"]
    weights = 2 * (960 * 576 + 576 * 576 + 3072 * 576 + 576 * 1536)
    for n, cold_ms, cold_gflops, cold_gbs, hot_ms, hot_gflops, ratio in rows:
        c, h = float(cold_ms) / 1e3, float(hot_ms) / 1e3
        assert abs(float(cold_gflops) - 2 * int(n) * weights / c / 1e9) <= 1 + 0.05 * float(cold_gflops)
        assert abs(float(cold_gbs) - 4 * weights / c / 1e9) <= 0.2 + 0.05 * float(cold_gbs)
        assert abs(float(hot_gflops) - 2 * int(n) * weights / h / 1e9) <= 1 + 0.05 * float(hot_gflops)
        assert abs(float(ratio.rstrip("x")) - c / h) <= 0.02 + 0.05 * c / h
