"""bench/kernel_bench.py shares its time budget between sections (section_deadline).

Why: with one deadline for all, the decode grid filled gpu_check's whole budget and every prefill
row read "skipped: time budget". Each section now gets an equal share of what is left when it starts.
"""

from __future__ import annotations

import time
from pathlib import Path

import pytest

from bench import kernel_bench


def test_section_deadline_is_an_equal_share_of_what_is_left() -> None:
    assert kernel_bench.section_deadline(10.0, 40.0, 3) == pytest.approx(20.0)
    assert kernel_bench.section_deadline(10.0, 40.0, 1) == pytest.approx(40.0)
    assert kernel_bench.section_deadline(50.0, 40.0, 2) == pytest.approx(50.0)  # past the end: nothing left


def test_a_greedy_section_leaves_time_for_the_next(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    measured: dict[str, int] = {}

    def greedy(
        b: kernel_bench.Bench,
    ) -> list[dict[str, object]]:  # like the decode grid: cases until out of time
        rows: list[dict[str, object]] = []
        for i in range(10_000):
            if b.out_of_time():
                rows.append({"case": i, "note": "skipped: time budget"})
                break
            time.sleep(0.01)
            rows.append({"case": i})
        measured["decode"] = sum(1 for r in rows if "note" not in r)
        return rows

    def small(b: kernel_bench.Bench) -> list[dict[str, object]]:  # like prefill: a few cases
        rows: list[dict[str, object]] = []
        for i in range(3):
            rows.append({"case": i, "note": "skipped: time budget"} if b.out_of_time() else {"case": i})
            if not b.out_of_time():
                time.sleep(0.01)
        measured["prefill"] = sum(1 for r in rows if "note" not in r)
        return rows

    monkeypatch.setattr(kernel_bench, "SECTIONS", {"decode": greedy, "prefill": small})
    t0 = time.monotonic()
    rc = kernel_bench.main(
        ["--smoke", "--sections", "decode,prefill", "--time-budget", "0.6", "--out", str(tmp_path)]
    )
    assert rc == 0
    assert time.monotonic() - t0 < 2.0
    assert measured["decode"] >= 5, measured
    assert measured["prefill"] == 3, (
        f"prefill rows skipped: the decode grid took the whole budget ({measured})"
    )
    assert "skipped: time budget" not in (tmp_path / "results.md").read_text().split("## prefill")[1]
