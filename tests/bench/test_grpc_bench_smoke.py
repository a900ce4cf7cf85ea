"""bench/grpc_bench.py --quick runs end to end: server subprocess, both modes, every row, targets."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_grpc_bench_quick(tmp_path: Path) -> None:
    out = tmp_path / "bench.json"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "bench.grpc_bench",
            "--quick",
            "--window",
            "0.1",
            "--in-flight",
            "16",
            "--json",
            str(out),
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=60,
        check=False,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    for label in (
        "Check (health, empty RPC: floor)",
        "Append (unary, 1 token)",
        "Step 256 seqs, packed arrays",
        "Step 256 seqs, sub-messages",
        "Step engine iteration (256+c/f/a)",
        "targets:",
        "80% of the floor",
        "100% of the floor",
        "p50 < 2 ms",
        "p50 <= 1.3 ms",
    ):
        assert label in proc.stdout
    data = json.loads(out.read_text())
    for row in ("Check", "GetStats", "Append", "Step/packed", "Step/sub", "Step/iteration"):
        for flight in (1, 16):
            cell = data[f"{row}@{flight}"]
            assert cell["count"] > 0 and cell["calls_per_s"] > 0
            assert 0 < cell["p50_ms"] <= cell["p99_ms"]
            # vs_floor is this row's calls/s over the floor's (Check) of the same run
            floor = data[f"Check@{flight}"]["calls_per_s"]
            assert abs(cell["vs_floor"] - cell["calls_per_s"] / floor) < 0.002 + 0.001 * cell["vs_floor"], (
                row,
                cell,
            )
    assert data["targets_ok"] == targets_from_numbers(data), data
    # The printed verdicts are the same numbers' (one line per target, "ok" or "MISS").
    verdicts = re.findall(r"^  .*(?:ok|MISS)$", proc.stdout, re.M)
    assert len(verdicts) == 5, proc.stdout
    assert all(v.endswith("ok") for v in verdicts if "sub-messages" not in v) == data["targets_ok"], (
        proc.stdout
    )


def targets_from_numbers(data: dict) -> bool:  # type: ignore[type-arg]
    """bench/grpc_bench.py's targets recomputed from its JSON: Append >= 80% of the floor's
    calls/s at 1 in flight and >= 100% of it at the concurrent level, and at 1 in flight Step/packed
    p50 < 2 ms and the engine iteration p50 <= 1.3 ms (the sub-messages row is shown, not a target)."""
    flights = sorted({int(k.rsplit("@", 1)[1]) for k in data if "@" in k})
    append_ok = all(
        data[f"Append@{f}"]["calls_per_s"] / data[f"Check@{f}"]["calls_per_s"] >= (0.8 if f == 1 else 1.0)
        for f in flights
    )
    return append_ok and data["Step/packed@1"]["p50_ms"] < 2.0 and data["Step/iteration@1"]["p50_ms"] <= 1.3


def test_targets_ok_is_what_the_numbers_say() -> None:
    """The verdict function on numbers made to pass and to miss each target."""
    from bench import grpc_bench as bench

    def cell(calls: int, ms: float) -> object:
        c = bench.Cell()
        c.latencies_ns = [int(ms * 1e6)] * calls
        c.seconds = 1.0
        return c

    def table(  # type: ignore[type-arg]
        append_ratio: float, packed_ms: float, iter_ms: float, append_ratio_n: float = 1.0
    ) -> dict:
        rows = {n: cell(1000, 0.5) for n in bench.ROWS}
        rows["Append"] = cell(int(1000 * append_ratio), 0.5)
        rows["Step/packed"] = cell(1000, packed_ms)
        rows["Step/iteration"] = cell(1000, iter_ms)
        rows_n = {n: cell(1000, 0.5) for n in bench.ROWS}
        rows_n["Append"] = cell(int(1000 * append_ratio_n), 0.5)
        return {1: rows, 16: rows_n}

    for args, want in (
        ((0.9, 1.0, 1.0), True),
        ((0.7, 1.0, 1.0), False),
        ((0.9, 2.5, 1.0), False),
        ((0.9, 1.0, 1.6), False),
        ((0.9, 1.0, 1.35), False),
        ((0.9, 1.0, 1.0, 0.95), False),
        ((0.9, 1.0, 1.0, 1.1), True),
    ):
        _, data, ok = bench.render(table(*args), 16)
        assert ok is want and data["targets_ok"] is want and targets_from_numbers(data) is want, args
