"""`pagedkv loadtest` against an in-process block manager: bounded runs, report fields, pool check."""

from __future__ import annotations

import argparse
import json

import pytest

from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.apps import loadtest
from pagedkv.frontend.clients.block_manager import BlockManagerClient


@pytest.fixture()
def target():  # type: ignore[no-untyped-def]
    running = start_server(BlockManagerSettings(port=0, num_gpu_blocks=2048, log_level="warning"))
    yield f"127.0.0.1:{running.port}"
    running.stop(None)


def _run(target: str, tmp_path, *extra: str) -> tuple[int, dict]:  # type: ignore[no-untyped-def]
    out = tmp_path / "report.json"
    rc = loadtest.main(["--target", target, "--format", "json", "--output", str(out), "--seed", "1", *extra])
    return rc, json.loads(out.read_text())


def test_bounded_mixed_run_reports_and_restores_the_pool(target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rc, rep = _run(target, tmp_path, "--total", "300", "-c", "8", "--step-size", "16")
    assert rc == 0
    assert rep["count"] >= 300 and rep["count"] <= 300 + 8 * 16  # a step op may add its admissions
    assert rep["status_code_distribution"] == {"OK": rep["count"]}
    assert rep["total_s"] > 0 and rep["rps"] > 0
    assert 0 < rep["fastest_ms"] <= rep["average_ms"] <= rep["slowest_ms"]
    pcts = [d["percentage"] for d in rep["latency_distribution"]]
    assert pcts == [10, 25, 50, 75, 90, 95, 99, 99.9]
    lat = [d["latency_ms"] for d in rep["latency_distribution"]]
    assert lat == sorted(lat)
    assert sum(b["count"] for b in rep["histogram"]) == rep["count"] and len(rep["histogram"]) == 10
    assert set(rep["calls"]) == {"Allocate", "Append", "Fork", "Free", "Step"}
    assert sum(c["count"] for c in rep["calls"].values()) == rep["count"]
    pool = rep["pool_check"]
    assert pool["ok"] and pool["after"]["num_sequences"] == pool["before"]["num_sequences"] == 0
    with BlockManagerClient(target) as bm:
        assert bm.get_stats().num_used_blocks == 0


def test_summary_format_and_duration_bound(target, capsys) -> None:  # type: ignore[no-untyped-def]
    rc = loadtest.main(["--target", target, "--duration", "0.5", "-c", "4", "--scenario", "lifecycle"])
    out = capsys.readouterr().out
    assert rc == 0
    for heading in (
        "Summary:",
        "Requests/sec:",
        "Response time histogram:",
        "Latency distribution:",
        "99.9 % in",
        "Status code distribution:",
        "[OK]",
        "Per call:",
        "ok: pool back where it started",
    ):
        assert heading in out
    total_ms = float(out.split("Total:")[1].split("ms")[0])
    assert 450 < total_ms < 3000


def test_rate_limit_is_respected(target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rc, rep = _run(target, tmp_path, "--total", "100", "-c", "4", "--rps", "200", "--scenario", "churn")
    assert rc == 0
    assert rep["count"] == 100
    assert rep["rps"] < 260  # 100 calls at 200/s take about half a second
    assert rep["total_s"] > 0.4


def test_several_connections_run_in_processes(target, tmp_path) -> None:  # type: ignore[no-untyped-def]
    rc, rep = _run(target, tmp_path, "--total", "300", "-c", "4", "--connections", "2", "--scenario", "fork")
    assert rc == 0
    assert rep["count"] == 300 and rep["status_code_distribution"] == {"OK": 300}
    assert rep["pool_check"]["ok"]


def test_a_leak_fails_the_pool_check(target, tmp_path, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    async def no_cleanup(self, client):  # type: ignore[no-untyped-def]
        return []

    monkeypatch.setattr(loadtest._Worker, "cleanup", no_cleanup)
    rc, rep = _run(target, tmp_path, "--total", "50", "-c", "2", "--scenario", "lifecycle")
    assert rc == 1
    assert not rep["pool_check"]["ok"] and rep["pool_check"]["after"]["num_sequences"] > 0


def test_configuration_errors_exit_2_before_any_load(target, capsys) -> None:  # type: ignore[no-untyped-def]
    assert (
        loadtest.main(["--target", target, "--total", "10", "--scenario", "decode", "--step-size", "4096"])
        == 2
    )
    assert "--num-gpu-blocks" in capsys.readouterr().err
    assert loadtest.main(["--target", "127.0.0.1:1", "--total", "10", "--timeout", "0.3"]) == 2
    assert "cannot reach" in capsys.readouterr().err
    with BlockManagerClient(target) as bm:
        assert bm.get_stats().num_sequences == 0


def test_mix_parsing() -> None:
    assert loadtest.parse_mix("allocate=1,append=8,free=1") == {"allocate": 1.0, "append": 8.0, "free": 1.0}
    assert loadtest.parse_mix("decode") == {"step": 1.0}
    assert loadtest.parse_mix("stats, fork=0") == {"stats": 1.0}
    for bad in ("launch=1", "append=-1", "append=x", "fork=0"):
        with pytest.raises(argparse.ArgumentTypeError):
            loadtest.parse_mix(bad)


def test_step_rotation_fits_the_budget() -> None:
    # 64 sequences of 32 tokens: a rotation of 4 keeps every sequence within 3 blocks
    assert loadtest.size_step_batch(64, 32, 16, 192) == 4
    assert loadtest.size_step_batch(64, 32, 16, 10_000) == 1
    with pytest.raises(loadtest.LoadTestError):
        loadtest.size_step_batch(64, 32, 16, 100)


def test_connection_processes_report_a_failed_setup_quickly() -> None:
    plans = [
        loadtest.PartPlan(
            target="127.0.0.1:1",
            index=i,
            workers=1,
            worker_offset=i,
            total=10,
            duration=None,
            rps_per_worker=0.0,
            mix={"stats": 1.0},
            num_tokens=4,
            step_size=1,
            step_rotate=0,
            max_live=1,
            max_seq_tokens=16,
            timeout_s=0.3,
            seed=1,
        )
        for i in range(2)
    ]
    results = loadtest.run_parts(plans, start_timeout_s=20)
    assert [r.fatal for r in results] == ["setup failed: no connection to 127.0.0.1:1 within 0.3 s"] * 2
