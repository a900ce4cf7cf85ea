"""Sliding-window attention (``sliding_window=``) on every backend against a float64 oracle.

Released blocks (wholly before the window of every query of their sequence) are NaN, and with
``minus_one`` their block-table entries -1: a backend that reads them returns NaN. Outputs start NaN,
so a row the kernel forgets is NaN too. The CPU backend's own paths (native kernels, buckets, bf16,
int8) are covered in tests/kernels/cpu/test_sliding_window.py; the Triton kernels run in Triton's
interpreter here (TRITON_INTERPRET=1, set for the suite) or compiled on a GPU.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import dispatch
from tests.kernels.cases import DEVICE, poisoned_like
from tests.kernels.window_cases import (
    DECODE_LENS,
    DECODE_WINDOWS,
    PREFILL_SHAPES,
    PREFILL_WINDOWS,
    WindowCase,
    build,
    check,
)


@pytest.fixture(params=["reference", "cpu", "triton"])
def backend(request: pytest.FixtureRequest) -> Iterator[str]:
    name = str(request.param)
    if name == "triton" and not dispatch.triton_available():
        pytest.skip("triton is not installed")
    if name == "triton" and DEVICE.type == "cpu" and not dispatch.triton_interpreted():
        pytest.skip("the Triton kernels on CPU need TRITON_INTERPRET=1")
    if name == "cpu" and DEVICE.type != "cpu":
        pytest.skip("the CPU backend takes CPU tensors")
    with kernels.use_backend(name):  # type: ignore[arg-type]
        yield name


def _dtypes(backend: str) -> list[torch.dtype]:
    # The interpreter has no bf16 math; fp16 is the CPU backend's bucket path.
    if backend == "triton":
        return [torch.float32, torch.float16] + ([torch.bfloat16] if DEVICE.type == "cuda" else [])
    return [torch.float32, torch.bfloat16, torch.float16]


def decode(case: WindowCase, **kw: object) -> torch.Tensor:
    out = poisoned_like(case.query)
    got = kernels.paged_decode_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        out=out,
        sliding_window=case.window,
        **kw,
    )
    assert got is out
    return got


def prefill(case: WindowCase) -> torch.Tensor:
    out = poisoned_like(case.query)
    got = kernels.paged_prefill_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
        out=out,
        sliding_window=case.window,
    )
    assert got is out
    return got


@pytest.mark.parametrize("window", DECODE_WINDOWS)
@pytest.mark.parametrize("release", ["nan", "minus_one"])
def test_decode_matches_the_oracle(backend: str, window: int, release: str) -> None:
    for i, dtype in enumerate(_dtypes(backend)):
        case = build(
            DECODE_LENS, [1] * len(DECODE_LENS), window, dtype=dtype, seed=window + i, release=release
        )
        assert case.released or window >= 40  # the small windows do release blocks
        check(case, decode(case))


@pytest.mark.parametrize("window", PREFILL_WINDOWS)
@pytest.mark.parametrize("release", ["nan", "minus_one"])
def test_prefill_matches_the_oracle(backend: str, window: int, release: str) -> None:
    seq_lens, q_lens = [s for s, _ in PREFILL_SHAPES], [q for _, q in PREFILL_SHAPES]
    for i, dtype in enumerate(_dtypes(backend)):
        case = build(seq_lens, q_lens, window, dtype=dtype, seed=window + 10 * i, release=release)
        check(case, prefill(case))


@pytest.mark.parametrize("window", [3, 24])
def test_gqa_groups_and_block_sizes(backend: str, window: int) -> None:
    """Odd groups (3, 7: SmolLM2, Qwen2), MQA, block sizes 8 and 32 (windows cross their boundaries)."""
    for heads, kvh, bs in [(9, 3, 8), (7, 1, 32), (8, 8, 16)]:
        case = build(
            [5, 40, 77], [1, 1, 1], window, num_heads=heads, num_kv_heads=kvh, block_size=bs, seed=bs
        )
        check(case, decode(case))
        case = build(
            [30, 77], [11, 40], window, num_heads=heads, num_kv_heads=kvh, block_size=bs, seed=bs + 1
        )
        check(case, prefill(case))


def test_decode_split_counts(backend: str) -> None:
    """Forced split-KV counts (the Triton decode's splits cut the window, not the context)."""
    case = build([3, 300, 129], [1, 1, 1], 70, seed=5, release="minus_one")
    for splits in (1, 2, 5):
        check(case, decode(case, num_splits=splits, max_seq_len=300))


def test_no_window_is_unchanged(backend: str) -> None:
    """``sliding_window=None`` is full causal attention (nothing released, nothing poisoned)."""
    case = build(DECODE_LENS, [1] * len(DECODE_LENS), None, seed=3)
    check(case, decode(case))
    case = build([s for s, _ in PREFILL_SHAPES], [q for _, q in PREFILL_SHAPES], None, seed=4)
    check(case, prefill(case))


def test_the_window_changes_the_result(backend: str) -> None:
    """The oracle with a window differs from the one without, by more than the tolerance: a backend
    that ignored the keyword would fail the tests above."""
    a = build([50, 95], [1, 1], 7, seed=9, release=None)
    b = build([50, 95], [1, 1], None, seed=9)
    assert (a.want - b.want).abs().max() > 0.05
    with pytest.raises(AssertionError):
        check(a, decode(b))


@pytest.mark.parametrize("bad", [0, -3, True, 2.5, "512"])
def test_invalid_windows_are_refused(bad: object) -> None:
    case = build([20], [1], None, seed=1)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        kernels.paged_decode_attention(
            case.query,
            case.key_cache,
            case.value_cache,
            case.block_tables,
            case.seq_lens,
            case.scale,
            sliding_window=bad,
        )
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        kernels.paged_prefill_attention(
            case.query,
            case.key_cache,
            case.value_cache,
            case.block_tables,
            case.query_start_loc,
            case.seq_lens,
            case.scale,
            sliding_window=bad,
        )


def test_released_entries_are_only_allowed_before_the_window() -> None:
    """Block-table entries before the window may hold -1; one the window reaches may not, and
    without a window none may (CPU index tensors are checked)."""
    case = build([50], [1], 7, seed=2, release="minus_one")  # p = 49 sees 43..49: blocks 2-3
    assert case.block_tables[0, :2].tolist() == [-1, -1]
    args = (case.query, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, case.scale)
    kernels.paged_decode_attention(*args, sliding_window=7)
    with pytest.raises(ValueError, match="block ids outside"):
        kernels.paged_decode_attention(*args)
    with pytest.raises(ValueError, match="block ids outside"):
        kernels.paged_decode_attention(*args, sliding_window=8 + 16)  # reaches block 1
    case.block_tables[0, 2] = -1
    with pytest.raises(ValueError, match="block ids outside"):
        kernels.paged_decode_attention(*args, sliding_window=7)


def _step(case: WindowCase, num_prefill_seqs: int, window: int | None) -> kernels.PagedStep:
    """A step over ``case``: its first ``num_prefill_seqs`` sequences prefill, the rest decode."""
    kv = torch.stack([case.key_cache, case.value_cache])[None]
    qsl, bt, sl = case.query_start_loc, case.block_tables, case.seq_lens
    n = int(qsl[num_prefill_seqs])
    return kernels.prepare_step(
        kv,
        case.query.shape[1],
        case.scale,
        torch.full((case.query.shape[0],), -1, dtype=torch.int64, device=DEVICE),
        n,
        prefill=(bt[:num_prefill_seqs], qsl[: num_prefill_seqs + 1], sl[:num_prefill_seqs]),
        decode=(bt[num_prefill_seqs:], sl[num_prefill_seqs:]),
        sliding_window=window,
    )


def test_step_attention_takes_each_layers_window(backend: str) -> None:
    """``PagedStep.attention(..., sliding_window=)``: a mixed prefill + decode step whose layers use
    different windows (Gemma 3: sliding and global layers) over the same validated metadata."""
    lens, q_lens = [40, 70, 33, 95, 17], [7, 33, 1, 1, 1]
    full = build(lens, q_lens, None, seed=11)
    step = _step(full, 2, None)
    kc, vc = full.key_cache, full.value_cache
    for window in (5, None, 16, 5):  # a plan per window, reused
        want = build(lens, q_lens, window, seed=11, release=None)
        check(want, step.attention(full.query, kc, vc, sliding_window=window))


def test_step_with_released_blocks(backend: str) -> None:
    """A step prepared with ``sliding_window`` accepts tables with released (-1) blocks; its layers
    must then attend within that window."""
    lens, q_lens = [40, 70, 33, 95, 17], [7, 33, 1, 1, 1]
    case = build(lens, q_lens, 16, seed=12, release="minus_one")
    assert case.released
    with pytest.raises(ValueError, match="block ids outside"):
        _step(case, 2, None)
    step = _step(case, 2, 16)
    check(case, step.attention(case.query, case.key_cache, case.value_cache, sliding_window=16))
    small = build(lens, q_lens, 9, seed=12, release=None)
    check(small, step.attention(case.query, case.key_cache, case.value_cache, sliding_window=9))
    for wider in (None, 17):
        with pytest.raises(ValueError, match="reaches past the step's sliding_window 16"):
            step.attention(case.query, case.key_cache, case.value_cache, sliding_window=wider)
    with pytest.raises(ValueError, match="sliding_window must be None or an int >= 1"):
        step.attention(case.query, case.key_cache, case.value_cache, sliding_window=0)


@pytest.mark.parametrize("window", [9, 40, 100])
def test_prefill_long_chunks_after_a_prefix(backend: str, window: int) -> None:
    """Chunks far into their sequences: the window's edge spans whole key tiles before the diagonal
    (Triton: masked edge tiles, unmasked middle ones, the diagonal), and most blocks are released."""
    case = build(
        [150, 200, 64], [20, 50, 64], window, num_heads=6, num_kv_heads=2, seed=window, release="minus_one"
    )
    assert case.released
    check(case, prefill(case))
