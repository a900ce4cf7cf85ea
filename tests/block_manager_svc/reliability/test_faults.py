"""CI-sized runs of bench/faults.py: SIGKILL under load (20 kills), injected retries, vanishing
lease holders, and a short soak. The full-size runs are `python -m bench.faults all`."""

from __future__ import annotations

import tempfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[3]


@pytest.fixture(scope="module")
def faults():  # type: ignore[no-untyped-def]
    from bench import faults

    return faults


def test_sigkill_under_load_loses_no_acknowledged_op(faults, tmp_path: Path) -> None:
    r = faults.run_crash(
        kills=20, clients=2, fsync="always", gap_s=(0.05, 0.25), num_gpu_blocks=256, workdir=tmp_path
    )
    assert r["restarts_ok"] == 20
    assert r["lost_or_mismatched"] == 0, r["problems"]
    assert r["acked_ops"] > 500 and r["calls_hit_by_kill"] > 0 and r["verifications"] >= 2
    # Clients freed everything at the end: the pool is whole again.
    assert (r["final_used"], r["final_sequences"], r["final_free"]) == (0, 0, r["total_blocks"])


def test_injected_faults_never_double_apply(faults) -> None:
    r = faults.run_retries(clients=3, ops=120, p_before=0.15, p_after=0.15)
    assert r["injected_after"] > 0 and r["injected_before"] > 0
    assert r["problems"] == 0, r["problem_samples"]
    assert r["dedupe_hits"] >= r["injected_after"]
    assert (r["used_blocks"], r["sequences"]) == (r["model_blocks"], r["model_sequences"])
    assert r["naive_double_applied"] == 10  # the control: without request ids retries do double-apply


def test_vanished_clients_blocks_come_back_within_ttl_plus_sweep(faults) -> None:
    r = faults.run_leases(ttl_s=0.6, sweep_s=0.1, clients=2, seqs=3)
    assert r["sequences_while_alive"] == 1 + 2 * 4  # renewals kept them past one TTL
    assert r["sequences_after"] == 1 and r["leases_expired"] == 2 and r["sequences_expired"] == 8
    assert r["reclaim_s"] <= 0.6 + 0.1 + 0.5  # TTL + one sweep (+ polling/scheduling slack)


def test_short_soak_returns_the_pool_and_keeps_memory_flat(faults, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a temp dir of its own: others may share /tmp
    r = faults.run_soak(seconds=6.0, fraction=0.7, threads=4, peak_window_s=1.5, samples=3)
    assert list(tmp_path.iterdir()) == []  # its state dir (journal, snapshots, log) is removed
    assert r["errors"] == 0, r["error_samples"]
    assert r["achieved_calls_s"] >= 0.5 * r["target_calls_s"]
    assert (r["sequences_after"], r["used_after"], r["free_after"]) == (0, 0, r["total_blocks"])
    assert r["rss_end_kib"] < r["rss_start_kib"] * 1.5 + 20_000
