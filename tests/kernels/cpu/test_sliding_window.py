"""Sliding-window attention on the CPU backend's own paths against the float64 oracle.

The native C kernels called directly (decode: the split path for up to 4 sequences and the one-task-
per-sequence path, specialised and generic (group, head_dim) copies; prefill's register tiles; fp32,
bf16, int8 caches; each build variant), bf16 prefill as per-row decode queries, the torch buckets
(no native kernels, fp16), and the cascade, which a window turns off. Released blocks are NaN (and
-1 in the table where the path must not dereference them); outputs start NaN.
"""

from __future__ import annotations

import functools

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import reference
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native
from tests.kernels import window_cases
from tests.kernels.cases import poisoned_like
from tests.kernels.window_cases import DECODE_LENS, PREFILL_SHAPES, WindowCase, check

native = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")


# The shared cases on CPU tensors: these kernels read host memory, on the GPU image too.
build = functools.partial(window_cases.build, device=torch.device("cpu"))


PREFILL_LENS = [s for s, _ in PREFILL_SHAPES]
PREFILL_Q = [q for _, q in PREFILL_SHAPES]


def _native_decode(case: WindowCase) -> torch.Tensor:
    out = poisoned_like(case.query)
    return cpu_native.decode(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        out,
        case.window,
    )


def _native_prefill(case: WindowCase) -> torch.Tensor:
    out = poisoned_like(case.query)
    return cpu_native.prefill(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
        out,
        case.window,
    )


def _backend_decode(case: WindowCase, plan: object | None = None) -> torch.Tensor:
    out = poisoned_like(case.query)
    return cpu.paged_decode_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.seq_lens,
        case.scale,
        out=out,
        plan=plan,
        sliding_window=case.window,
    )


def _backend_prefill(case: WindowCase, plan: object | None = None) -> torch.Tensor:
    out = poisoned_like(case.query)
    return cpu.paged_prefill_attention(
        case.query,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        case.query_start_loc,
        case.seq_lens,
        case.scale,
        out=out,
        plan=plan,
        sliding_window=case.window,
    )


# (num_heads, num_kv_heads, head_dim): specialised copies (group 2 / 3 at 64, group 4 at 128) and
# the generic one (group 3 at 48, group 2 at 32).
SHAPES = [(4, 2, 64), (9, 3, 64), (8, 2, 128), (6, 2, 48)]


@native
@pytest.mark.parametrize("window", [1, 7, 33, 200])
@pytest.mark.parametrize("kind", ["fp32", "bf16", "int8"])
def test_native_decode(window: int, kind: str, variant: str) -> None:
    """``variant``: each build's vector width. The whole batch (one task per sequence) and its first
    three sequences (the split path, fp32 outputs only, its first run starting at the window)."""
    dtype = torch.bfloat16 if kind == "bf16" else torch.float32
    kv = "int8" if kind == "int8" else "float"
    lens = DECODE_LENS + [160, 129]
    for heads, kvh, d in SHAPES:
        if kind == "int8" and d % 4:
            continue
        for batch in (lens, [95, 160, 129]):
            case = build(
                batch,
                [1] * len(batch),
                window,
                num_heads=heads,
                num_kv_heads=kvh,
                head_dim=d,
                dtype=dtype,
                kv=kv,
                seed=window + d,
                release="minus_one",
            )
            check(case, _native_decode(case))


@native
@pytest.mark.parametrize("window", [1, 6, 16, 33])
@pytest.mark.parametrize("kind", ["fp32", "int8"])
def test_native_prefill(window: int, kind: str, variant: str) -> None:
    """Rows of a task (16 or 32) whose windows start in different blocks; chunks after a prefix."""
    lens, q_lens = PREFILL_LENS + [150, 100], PREFILL_Q + [70, 3]
    for heads, kvh, d in [(4, 2, 64), (9, 3, 64), (2, 2, 128)]:
        case = build(
            lens,
            q_lens,
            window,
            num_heads=heads,
            num_kv_heads=kvh,
            head_dim=d,
            kv="int8" if kind == "int8" else "float",
            seed=window + d,
            release="minus_one",
        )
        check(case, _native_prefill(case))


@pytest.mark.parametrize("window", [1, 7, 33, 200])
@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_decode_paths(window: int, native_on: bool, dtype: torch.dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """The backend on the native kernel, and on the buckets (no native kernels; fp16 always)."""
    if native_on and not cpu_native.available():
        pytest.skip("native kernels not built")
    if not native_on:
        monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    case = build(DECODE_LENS + [0], [1] * len(DECODE_LENS) + [0], window, dtype=dtype, seed=window)
    # The last sequence has nothing cached (q_len 0 above: no oracle row): it attends to nothing.
    case.query = torch.cat([case.query, torch.randn(1, *case.query.shape[1:]).to(dtype)])
    case.want = torch.cat([case.want, torch.zeros(1, *case.want.shape[1:], dtype=torch.float64)])
    plan = cpu.plan_decode(case.block_tables, case.seq_lens, 16, window)
    assert plan.sliding_window == window
    check(case, _backend_decode(case, plan))
    check(case, _backend_decode(case))


@pytest.mark.parametrize("window", [1, 6, 16, 300])
@pytest.mark.parametrize("native_on", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_backend_prefill_paths(window: int, native_on: bool, dtype: torch.dtype, monkeypatch) -> None:  # type: ignore[no-untyped-def]
    """Native prefill kernel (fp32), per-row decode queries (bf16), buckets (no native; fp16)."""
    if native_on and not cpu_native.available():
        pytest.skip("native kernels not built")
    if not native_on:
        monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    case = build(PREFILL_LENS + [150], PREFILL_Q + [70], window, dtype=dtype, seed=window + 1)
    plan = cpu.plan_prefill(case.block_tables, case.query_start_loc, case.seq_lens, 16, 2, window)
    check(case, _backend_prefill(case, plan))
    check(case, _backend_prefill(case))


def test_backend_int8_without_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """int8 caches without the native kernels: the dequantizing reference, window included."""
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    case = build(DECODE_LENS, [1] * len(DECODE_LENS), 9, kv="int8", seed=3)
    check(case, _backend_decode(case))
    case = build(PREFILL_LENS, PREFILL_Q, 9, kv="int8", seed=4)
    check(case, _backend_prefill(case))


def test_a_plan_for_another_window_is_not_used() -> None:
    """A plan built for full attention (or another window) passed to a windowed call is rebuilt."""
    case = build(DECODE_LENS, [1] * len(DECODE_LENS), 7, seed=5)
    for window in (None, 8):
        check(case, _backend_decode(case, cpu.plan_decode(case.block_tables, case.seq_lens, 16, window)))
    case = build(PREFILL_LENS, PREFILL_Q, 7, seed=6)
    for window in (None, 8):
        plan = cpu.plan_prefill(case.block_tables, case.query_start_loc, case.seq_lens, 16, 2, window)
        check(case, _backend_prefill(case, plan))


@pytest.mark.parametrize("native_on", [True, False])
def test_no_cascade_under_a_window(native_on: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Sequences sharing their first blocks (a cached system prompt) attend to them once per group
    without a window; with one the shared prefix would hold keys outside the members' windows, so
    the plans hold no cascade and no shared prefix, and the result is the reference's."""
    if native_on and not cpu_native.available():
        pytest.skip("native kernels not built")
    if not native_on:
        monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    monkeypatch.setattr(cpu, "NATIVE_CASCADE_MIN_SAVED_TOKENS", 1)
    monkeypatch.setattr(cpu, "CASCADE_MIN_SAVED_TOKENS", 1)
    gen = torch.Generator().manual_seed(8)
    kc, vc = torch.randn(40, 16, 2, 64, generator=gen), torch.randn(40, 16, 2, 64, generator=gen)
    shared = [0, 1, 2, 3, 4]
    bt = torch.tensor([shared + [5 + i, 10 + i, 15 + i] for i in range(4)], dtype=torch.int32)
    lens = torch.tensor([100, 120, 97, 128], dtype=torch.int32)
    q = torch.randn(4, 4, 64, generator=gen)
    full = cpu.plan_decode(bt, lens, 16)
    assert full.cascade is not None or full.shared
    plan = cpu.plan_decode(bt, lens, 16, 40)
    assert plan.cascade is None and not plan.shared
    for p in (plan, None):
        got = cpu.paged_decode_attention(
            q, kc, vc, bt, lens, 0.125, out=poisoned_like(q), plan=p, sliding_window=40
        )
        want = reference.paged_decode_attention(q, kc, vc, bt, lens, 0.125, sliding_window=40)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


def test_the_step_uses_the_native_kernels_with_a_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """Through ``PagedStep.attention`` the windowed layers run the native kernels (not a fallback)."""
    if not cpu_native.available():
        pytest.skip("native kernels not built")
    seen: list[object] = []
    real_decode, real_prefill = cpu_native.decode, cpu_native.prefill

    def spy_decode(*a: object) -> torch.Tensor:
        seen.append(("decode", a[7] if len(a) > 7 else None))
        return real_decode(*a)  # type: ignore[arg-type]

    def spy_prefill(*a: object) -> torch.Tensor:
        seen.append(("prefill", a[8] if len(a) > 8 else None))
        return real_prefill(*a)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_native, "decode", spy_decode)
    monkeypatch.setattr(cpu_native, "prefill", spy_prefill)
    lens, q_lens = [40, 70, 33, 95], [7, 33, 1, 1]
    case = build(lens, q_lens, 16, seed=12, release="minus_one")
    kv = torch.stack([case.key_cache, case.value_cache])[None]
    n = int(case.query_start_loc[2])
    with kernels.use_backend("cpu"):
        step = kernels.prepare_step(
            kv,
            4,
            case.scale,
            torch.full((case.query.shape[0],), -1, dtype=torch.int64),
            n,
            prefill=(case.block_tables[:2], case.query_start_loc[:3], case.seq_lens[:2]),
            decode=(case.block_tables[2:], case.seq_lens[2:]),
            sliding_window=16,
        )
    check(case, step.attention(case.query, case.key_cache, case.value_cache, sliding_window=16))
    assert seen == [("prefill", 16), ("decode", 16)]
