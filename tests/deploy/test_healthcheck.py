"""pagedkv.healthcheck: exit 0 on SERVING, 1 on anything else."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from pagedkv import healthcheck
from pagedkv.block_manager_svc.server import start_server
from pagedkv.block_manager_svc.settings import BlockManagerSettings

ROOT = Path(__file__).resolve().parents[2]


def test_serving_unknown_service_and_unreachable(capsys) -> None:  # type: ignore[no-untyped-def]
    running = start_server(BlockManagerSettings(port=0, log_level="warning"))
    try:
        target = f"127.0.0.1:{running.port}"
        assert healthcheck.main([target]) == 0
        assert "SERVING" in capsys.readouterr().out
        assert healthcheck.main([target, "--service", "pagedkv.v1.BlockManager"]) == 0
        assert healthcheck.main([target, "--service", "no.such.Service", "-q"]) == 1
        running.health.enter_graceful_shutdown()  # NOT_SERVING while draining
        assert healthcheck.main([target]) == 1
    finally:
        running.stop(None)
    assert healthcheck.main([target, "--timeout", "0.3"]) == 1
    assert capsys.readouterr().err  # says why (unreachable)


def test_module_entry_point_uses_pagedkv_port() -> None:
    running = start_server(BlockManagerSettings(port=0, log_level="warning"))
    try:
        proc = subprocess.run(
            [sys.executable, "-m", "pagedkv.healthcheck"],
            cwd=ROOT,
            capture_output=True,
            text=True,
            timeout=20,
            check=False,
            env={"PAGEDKV_PORT": str(running.port), "PATH": ""},
        )
        assert proc.returncode == 0, proc.stderr
        assert f"127.0.0.1:{running.port}: SERVING" in proc.stdout
    finally:
        running.stop(None)
