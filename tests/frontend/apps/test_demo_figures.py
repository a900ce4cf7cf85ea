"""`pagedkv demo`'s KV figures mean what their labels say (vLLM paper's utilisation, sharing apart)."""

from __future__ import annotations

from pagedkv.frontend.apps.demo import DemoFigures, kv_occupancy, report
from pagedkv.frontend.engine import SeqStatus


class Seq:
    def __init__(
        self, tokens: int, table: list[int], needs_slot: bool = False, status: SeqStatus = SeqStatus.RUNNING
    ) -> None:
        self.tokens = list(range(tokens))
        self.block_table = table
        self.needs_slot = needs_slot
        self.status = status


def test_shared_blocks_count_once_in_slots_and_in_tokens() -> None:
    # Two sequences share a 2-block prefix (32 tokens) and each has its own partly filled block.
    a = Seq(40, [0, 1, 2])
    b = Seq(37, [0, 1, 3], needs_slot=True)  # its last token has no slot yet: 36 held
    occ = kv_occupancy([a, b], 16)
    assert (occ.physical_blocks, occ.logical_blocks) == (4, 6)
    assert occ.live_tokens == 32 + 8 + 4
    assert occ.utilisation(16) == 44 / 64
    # Counting every sequence's tokens over the shared slots would have claimed (40 + 36) / 64 > 100%.
    assert (40 + 36) / 64 > 1 >= occ.utilisation(16)


def test_forked_partial_block_and_finished_sequences() -> None:
    parent = Seq(20, [5, 6])
    child = Seq(20, [5, 6])  # forked: shares the partly filled block too
    done = Seq(17, [7, 8], status=SeqStatus.FINISHED)  # its final token was never given a slot
    occ = kv_occupancy([parent, child, done], 16)
    assert occ.live_tokens == 16 + 4 + 16 + 0
    assert (occ.physical_blocks, occ.logical_blocks) == (4, 6)


def test_report_prints_utilisation_and_sharing_on_their_own_lines() -> None:
    f = DemoFigures(
        requests=1,
        generated_tokens=1,
        prompt_tokens=1,
        wall_s=1.0,
        util_mean=0.9,
        util_min=0.8,
        shared_mean=0.25,
        peak_saved_blocks=10,
        peak_paged_blocks=20,
        peak_contiguous_tokens=640,
        bytes_per_token=1024,
        block_size=16,
    )
    text = report(f)
    assert "KV utilisation: live token slots / allocated slots (mean, min)  90.0%, 80.0%" in text
    assert "KV memory saved by block sharing (mean, peak)" in text and "peak 10 blocks (0.16 MiB)" in text
