"""bench/bm_round_trips.py runs and counts what the engine did: without deferral one Step per
iteration; with it, one sequence makes a Step only when it needs a new block (and to start and end);
with blocks granted ahead, fewer still, and two sequences no more than with deferral alone."""

from __future__ import annotations

from pagedkv.defaults import DECODE_STEPS
from tests.bench.tables import data_rows, run_bench


def test_round_trips_per_iteration() -> None:
    out = run_bench(
        "bm_round_trips", "--sequences", "1,2", "--max-tokens", "12", "--block-size", "4", timeout=300
    )
    rows = data_rows(out)
    for r in rows:  # Steps per generated token: each of n sequences generated 12
        assert abs(float(r[6]) - int(r[3]) / (12 * int(r[0]))) < 1e-3, r
    by = {(int(r[0]), r[1]): (int(r[2]), int(r[3]), float(r[4]), int(r[5])) for r in rows}
    multi = f"deferred + granted ahead + {DECODE_STEPS} decode steps a call"
    modes = ("every iteration", "deferred appends", "deferred + granted ahead")
    assert set(by) == {(n, m) for n in (1, 2) for m in (*modes, multi)}
    for n in (1, 2):
        iterations, steps, per, granted = by.pop((n, multi))
        assert abs(per - steps / iterations) < 1e-3 and granted > 0
        # the same tokens in fewer iterations (12 in 4-token blocks: each call goes to its block's end)
        assert iterations < by[(n, "deferred + granted ahead")][0] - 4
        assert steps <= by[(n, "deferred + granted ahead")][1]
    for (n, mode), (iterations, steps, per, granted) in by.items():
        assert abs(per - steps / iterations) < 1e-3
        # the same requests (a finished sequence whose owed appends go first takes one more to free)
        assert 0 <= iterations - by[(n, "every iteration")][0] <= 1
        if mode == "every iteration":
            assert steps == iterations, "without deferral every iteration makes a Step"
        assert (granted > 0) == (mode == "deferred + granted ahead")
    iterations, deferred, _, _ = by[(1, "deferred appends")]
    # 12 tokens in 4-token blocks: a new block every 4 tokens, plus the allocation and the free
    assert iterations == 13 and deferred <= 12 // 4 + 2
    for n in (1, 2):
        assert by[(n, "deferred + granted ahead")][1] < by[(n, "deferred appends")][1]
