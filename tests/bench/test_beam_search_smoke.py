"""bench.beam_search on the built-in tiny model, small: the beams hold fewer blocks than n
independent sequences of the same length, copy on write where they part, and nothing is held
after any of the requests."""

from __future__ import annotations

from tests.bench.tables import data_rows, run_bench


def test_beams_hold_fewer_blocks_than_independent_sequences_and_leave_none() -> None:
    out = run_bench("beam_search", "--tiny", "--widths", "2,4", "--prompt-tokens", "40", "--max-tokens", "16")
    rows = data_rows(out)
    assert [r[0] for r in rows] == ["2", "4"]
    for n, beam, apart, ratio, cached, cow, after in rows:
        beam_peak, apart_peak = int(beam.split()[0]), int(apart.split()[0])
        assert beam_peak < apart_peak == int(n) * 4  # 56 tokens: 4 blocks of 16 each
        assert float(ratio) < 1 and int(cow) > 0
        assert int(cached.split()[0]) < apart_peak  # prefix caching shares the prompt's full blocks
        assert after == "0, 0, 0"
