"""bench/bm_round_trips.py runs and counts what the engine did: without deferral one Step per
iteration; with it, one sequence makes a Step only when it needs a new block (and to start and end)."""

from __future__ import annotations

from tests.bench.tables import data_rows, run_bench


def test_round_trips_per_iteration() -> None:
    out = run_bench(
        "bm_round_trips", "--sequences", "1,2", "--max-tokens", "12", "--block-size", "4", timeout=300
    )
    by = {(int(r[0]), r[1]): (int(r[2]), int(r[3]), float(r[4])) for r in data_rows(out)}
    assert set(by) == {(1, "False"), (1, "True"), (2, "False"), (2, "True")}
    for (_, defer), (iterations, steps, per) in by.items():
        assert abs(per - steps / iterations) < 1e-3
        if defer == "False":
            assert steps == iterations, "without deferral every iteration makes a Step"
    iterations, steps, _ = by[(1, "True")]
    # 12 tokens in 4-token blocks: a new block every 4 tokens, plus the allocation and the free
    assert iterations == 13 and steps <= 12 // 4 + 2
