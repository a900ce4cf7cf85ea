"""bench/cpu_decode_bench.py runs end to end (every path's output agrees, it checks that first), the
native cascade is the product's path where a group saves enough, and its ratio columns are its own
times' arithmetic."""

from __future__ import annotations

import pytest

from pagedkv.kernels.cpu import native as cpu_native
from tests.bench.tables import data_rows, run_bench


@pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built: nothing to compare")
def test_cpu_decode_bench_quick() -> None:
    out = run_bench(
        "cpu_decode_bench",
        "--threads",
        "1",
        "--reps",
        "1",
        "--head-dims",
        "64",
        "--gqa-groups",
        "",
        "--shapes",
        "4",
    )
    rows = data_rows(out)
    assert [r[1] for r in rows] == [
        "chat burst, 8 seqs, 3 prompts of 192 tok",
        "chat burst, 48 seqs, 3 prompts of 192 tok",
        "16 seqs, 4 prefixes of 432 tok, short own",
        "64 seqs, 4 prefixes of 432 tok, short own",
    ]
    for row in rows:
        flat, cascade, buckets, native_flat, native = (float(c.split(" (")[0]) for c in row[2:7])
        assert native_flat > 0 and native > 0
        # a group of 16 on a 432-token prefix saves 15 x 432 tokens: two calls a layer (the cascade)
        assert row[6].endswith("(2)") == (row[1] == "64 seqs, 4 prefixes of 432 tok, short own")
        assert row[5].endswith("(1)")
        ratios = ((7, buckets, flat), (8, buckets, cascade), (9, native, buckets), (10, native, native_flat))
        for col, a, b in ratios:
            assert abs(float(row[col].rstrip("x")) - a / b) <= 0.01 + 0.01 * a / b
