"""frontend/engine/admission.py: when a waiting request is held back for a prefix another sequence
computes."""

from __future__ import annotations

import random

from hypothesis import given
from hypothesis import strategies as st

from pagedkv.frontend.engine.admission import PrefixProgress, shared_full_blocks

BS = 4


def test_shared_full_blocks_counts_whole_equal_blocks_only() -> None:
    a = [1, 2, 3, 4, 5, 6, 7, 8, 9]
    assert shared_full_blocks(a, a, BS, 10) == 2
    assert shared_full_blocks(a, [1, 2, 3, 4, 5, 6, 7, 0, 9], BS, 10) == 1  # second block differs
    assert shared_full_blocks(a, [1, 2, 3, 4, 5, 6], BS, 10) == 1  # b's second block is partial
    assert shared_full_blocks(a, a, BS, 1) == 1  # capped


@given(
    st.lists(st.integers(0, 3), min_size=0, max_size=24), st.lists(st.integers(0, 3), min_size=0, max_size=24)
)
def test_shared_full_blocks_agrees_with_a_token_by_token_count(a: list[int], b: list[int]) -> None:
    common = 0
    while common < min(len(a), len(b)) and a[common] == b[common]:
        common += 1
    assert shared_full_blocks(a, b, BS, 100) == min(common, len(a), len(b)) // BS


def test_held_while_a_writer_still_computes_the_shared_prefix() -> None:
    rng = random.Random(0)
    prefix = [rng.randrange(1000) for _ in range(12)]  # 3 blocks
    p = PrefixProgress(BS)
    p.add(prefix + [1, 2, 3], num_computed=0)  # admitted in this Step, nothing computed yet
    assert p.should_hold(prefix + [9, 9])
    p2 = PrefixProgress(BS)
    p2.add(prefix + [1, 2, 3], num_computed=8)  # 2 of the 3 shared blocks computed: one more to gain
    assert p2.should_hold(prefix + [9, 9])
    p3 = PrefixProgress(BS)
    p3.add(prefix + [1, 2, 3], num_computed=12)  # all shared blocks computed: admit now, with hits
    assert not p3.should_hold(prefix + [9, 9])


def test_not_held_when_another_writer_already_covers_the_prefix() -> None:
    prefix = list(range(100, 112))
    p = PrefixProgress(BS)
    p.add(prefix + [1], num_computed=13)  # done: committed in this Step
    p.add(prefix + [2], num_computed=0)  # newly admitted beside it
    assert not p.should_hold(prefix + [3])


def test_not_held_for_other_prefixes_short_prompts_or_the_last_token() -> None:
    p = PrefixProgress(BS)
    p.add(list(range(8)) + [50], num_computed=0)
    assert not p.should_hold(list(range(1, 9)) + [50])  # different first block
    assert not p.should_hold([0, 1, 2])  # no full block before its last token
    assert not p.should_hold([0, 1, 2, 3])  # its only full block holds the last token: never a hit
    assert p.should_hold([0, 1, 2, 3, 4])
