"""bench/trace_replay.py meets its targets on the tiny traces."""

from __future__ import annotations

import pathlib
import sys

sys.path.insert(0, str(pathlib.Path(__file__).resolve().parents[3] / "bench"))

import trace_replay  # noqa: E402


def test_smoke_run_meets_targets(capsys) -> None:  # type: ignore[no-untyped-def]
    assert trace_replay.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") + out.count("ok\n") >= 4 and "MISS" not in out
