"""bench/trace_replay.py meets its targets on the tiny traces."""

from __future__ import annotations

from bench import trace_replay


def test_smoke_run_meets_targets(capsys) -> None:  # type: ignore[no-untyped-def]
    assert trace_replay.main(["--smoke"]) == 0
    out = capsys.readouterr().out
    assert out.count(": ok") + out.count("ok\n") >= 4 and "MISS" not in out


def test_overload_replays_through_the_engine_for_real(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Experiment 4 (--engine): the overload trace really runs through the engine on the CPU
    backend, each mode really preempts the way it says, and greedy outputs do not depend on it."""
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")
    cost = {"kv_bytes_per_block": 8192, "host_link_gb_per_s": 10.0, "prefill_tokens_per_s": 10_000.0}
    swap = trace_replay.run_overload_engine("swap", 0, 10, cost)
    recompute = trace_replay.run_overload_engine("recompute", 0, 10, cost)
    assert swap["completed"] == recompute["completed"] == 10
    assert swap["swap"] > 0 and recompute["recompute"] > 0 and recompute["swap"] == 0
    assert swap["tokens"] == recompute["tokens"]
    assert recompute["computed"] > swap["computed"]  # recompute redid prefill work that swap kept
    assert swap["wall_s"] > 0 and recompute["wall_s"] > 0
