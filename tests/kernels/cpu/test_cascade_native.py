"""The native cascade (cpu_native.cascade: the decode kernel's own parts with their log-sum-exps, then
each shared prefix once on the prefill kernel, merged in place), reached through the CPU backend's
plan, against the plain-torch reference: fresh random inputs, NaN in every cache slot no sequence
owns and in the output before the call."""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv.kernels import reference
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native

pytestmark = pytest.mark.skipif(not cpu_native.available(), reason="native kernels not built")


@pytest.fixture(autouse=True)
def small_groups_cascade(monkeypatch: pytest.MonkeyPatch) -> None:
    """These batches are small: let groups saving 256 tokens or more take the cascade (the rule
    itself is checked with its real value in test_the_threshold_is_the_saving_of_a_group)."""
    monkeypatch.setattr(cpu, "NATIVE_CASCADE_MIN_SAVED_TOKENS", 256)


def _batch(
    seed: int,
    groups: list[tuple[int, int]],
    loners: int,
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
) -> tuple[torch.Tensor, ...]:
    """``groups``: (members, shared blocks) whose block tables start with the same physical blocks (as
    prefix-cache hits do), each member with 1-40 tokens of its own after them; ``loners`` sequences
    share nothing. Sequences interleave across groups; unowned slots and blocks hold NaN."""
    rnd, g = random.Random(seed), torch.Generator().manual_seed(seed)
    plan = [(gi, nb) for gi, (members, nb) in enumerate(groups) for _ in range(members)]
    plan += [(-1, 0)] * loners
    rnd.shuffle(plan)
    own = [rnd.randint(1, 40) for _ in plan]
    num_blocks = sum(nb for _, nb in groups) + sum(-(-n // block_size) for n in own) + 3
    free = list(range(1, num_blocks))
    rnd.shuffle(free)
    kc = torch.full((num_blocks, block_size, kv_heads, head_dim), float("nan"))
    vc = torch.full_like(kc, float("nan"))

    def fill(block: int, used: int) -> None:
        kc[block, :used] = torch.randn(used, kv_heads, head_dim, generator=g)
        vc[block, :used] = torch.randn(used, kv_heads, head_dim, generator=g)

    prefixes = []
    for _, nb in groups:
        blocks = [free.pop() for _ in range(nb)]
        for b in blocks:
            fill(b, block_size)
        prefixes.append(blocks)
    tables, lens = [], []
    for (gi, nb), n in zip(plan, own, strict=True):
        mine = [free.pop() for _ in range(-(-n // block_size))]
        for i, b in enumerate(mine):
            fill(b, min(block_size, n - i * block_size))
        tables.append((prefixes[gi] if gi >= 0 else []) + mine)
        lens.append(nb * block_size + n)
    width = max(len(t) for t in tables)
    bt = torch.tensor([t + [0] * (width - len(t)) for t in tables], dtype=torch.int32)
    query = torch.randn(len(plan), heads, head_dim, generator=g)
    return query, kc, vc, bt, torch.tensor(lens, dtype=torch.int32)


def _finite(kc: torch.Tensor, vc: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """The caches for the reference, which gathers padding slots too (weight 0, but 0 x NaN is NaN):
    the kernels under test get the NaN-poisoned ones."""
    return kc.nan_to_num(), vc.nan_to_num()


SHAPES = [(8, 2, 64, 16), (9, 3, 64, 16), (4, 4, 64, 8), (16, 2, 128, 16), (6, 3, 128, 32), (4, 1, 16, 16)]


@pytest.mark.parametrize(("heads", "kv_heads", "head_dim", "block_size"), SHAPES)
@pytest.mark.parametrize(
    ("groups", "loners"),
    [([(3, 16)], 0), ([(16, 27), (16, 27), (5, 12)], 3), ([(3, 64)], 2), ([(40, 8), (2, 40)], 5)],
)
def test_the_backend_cascade_matches_the_reference(
    heads: int,
    kv_heads: int,
    head_dim: int,
    block_size: int,
    groups: list[tuple[int, int]],
    loners: int,
    variant: str,  # each build's register tiles
) -> None:
    query, kc, vc, bt, lens = _batch(
        heads + head_dim + len(groups), groups, loners, heads, kv_heads, head_dim, block_size
    )
    plan = cpu.plan_decode(bt, lens, block_size)
    assert plan.cascade is not None  # these groups save enough: the cascade is what runs
    assert plan.cascade.prefix_starts.shape[0] - 1 == len(groups)
    scale = head_dim**-0.5
    out = torch.full_like(query, float("nan"))
    assert cpu.paged_decode_attention(query, kc, vc, bt, lens, scale, out=out, plan=plan) is out
    want = reference.paged_decode_attention(query, *_finite(kc, vc), bt, lens, scale)
    torch.testing.assert_close(out, want, rtol=2e-5, atol=2e-5)


def test_the_cascade_is_what_runs_and_equals_the_plain_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    query, kc, vc, bt, lens = _batch(11, [(12, 20), (6, 10)], 4, 9, 3, 64, 16)
    plan = cpu.plan_decode(bt, lens, 16)
    calls = []
    real = cpu_native.cascade

    def spy(*args: object, **kwargs: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_native, "cascade", spy)
    out = cpu.paged_decode_attention(query, kc, vc, bt, lens, 0.125, plan=plan)
    assert calls == [1]
    flat = cpu_native.decode(query, kc, vc, bt, lens, 0.125, torch.full_like(query, float("nan")))
    torch.testing.assert_close(out, flat, rtol=2e-5, atol=2e-5)


def test_without_groups_the_cascade_is_the_decode_kernel() -> None:
    query, kc, vc, bt, lens = _batch(5, [(2, 4)], 0, 8, 2, 64, 16)
    out = torch.full_like(query, float("nan"))
    empty = torch.zeros(0, 1, dtype=torch.int32)
    none = torch.zeros(0, dtype=torch.int32)
    cpu_native.cascade(
        query, kc, vc, bt, lens, empty, torch.zeros(1, dtype=torch.int32), none, none, 0.125, out
    )
    torch.testing.assert_close(
        out, reference.paged_decode_attention(query, *_finite(kc, vc), bt, lens, 0.125), rtol=2e-5, atol=2e-5
    )


def test_small_groups_stay_on_the_plain_kernel() -> None:
    """Two members sharing 4 blocks of 16 save 64 tokens: below NATIVE_CASCADE_MIN_SAVED_TOKENS."""
    query, kc, vc, bt, lens = _batch(3, [(2, 4)], 1, 8, 2, 64, 16)
    assert cpu.plan_decode(bt, lens, 16).cascade is None


def test_the_threshold_is_the_saving_of_a_group(monkeypatch: pytest.MonkeyPatch) -> None:
    """(members - 1) x shared tokens: a group exactly at the rule takes the cascade, one block less
    does not (and then no other group makes the plan take it)."""
    monkeypatch.undo()  # the real rule
    members, block = 5, 16
    at = cpu.NATIVE_CASCADE_MIN_SAVED_TOKENS // ((members - 1) * block)
    for shared, taken in ((at, True), (at - 1, False)):
        tables = [list(range(shared)) + [shared + i] for i in range(members)]
        bt = torch.tensor(tables, dtype=torch.int32)
        lens = torch.tensor([shared * block + 1] * members, dtype=torch.int32)
        plan = cpu.plan_decode(bt, lens, block)
        assert (plan.cascade is not None) == taken


def test_the_result_does_not_depend_on_the_thread_count() -> None:
    query, kc, vc, bt, lens = _batch(7, [(10, 16), (7, 30)], 3, 9, 3, 64, 16)
    plan = cpu.plan_decode(bt, lens, 16)
    assert plan.cascade is not None
    before, results = torch.get_num_threads(), []
    try:
        for threads in (1, 2, 3):
            torch.set_num_threads(threads)
            results.append(cpu.paged_decode_attention(query, kc, vc, bt, lens, 0.125, plan=plan))
    finally:
        torch.set_num_threads(before)
    assert torch.equal(results[0], results[1]) and torch.equal(results[0], results[2])


def test_bf16_takes_the_plain_kernel_or_the_buckets() -> None:
    """The prefill kernel is fp32 only: a bf16 cache runs the decode kernel on the same plan."""
    query, kc, vc, bt, lens = _batch(9, [(12, 20)], 2, 8, 2, 64, 16)
    plan = cpu.plan_decode(bt, lens, 16)
    assert plan.cascade is not None and not plan.buckets_first
    q16, k16, v16 = query.bfloat16(), kc.bfloat16(), vc.bfloat16()
    out = cpu.paged_decode_attention(q16, k16, v16, bt, lens, 0.125, plan=plan)
    want = reference.paged_decode_attention(q16.float(), *_finite(k16.float(), v16.float()), bt, lens, 0.125)
    torch.testing.assert_close(out.float(), want, rtol=2e-2, atol=2e-2)


def test_bad_arguments_raise_and_write_nothing() -> None:
    query, kc, vc, bt, lens = _batch(13, [(4, 8)], 1, 8, 2, 64, 16)
    nc = cpu.plan_decode(bt, lens, 16).cascade
    assert nc is not None
    out = torch.full_like(query, float("nan"))
    good = [nc.own_tables, nc.own_lens, nc.prefix_tables, nc.prefix_starts, nc.prefix_lens, nc.row_map]
    bad: list[tuple[list[torch.Tensor], str]] = [
        ([*good[:5], good[5].long()], "row_map"),
        ([*good[:3], good[3][:-1], *good[4:]], "prefix_starts"),
        ([*good[:5], good[5] + 100], "row_map"),
        ([*good[:5], good[5][:-1]], "prefix_starts"),
        ([good[0].long(), *good[1:]], "block_tables"),
    ]
    for args, message in bad:
        with pytest.raises(ValueError, match=message):
            cpu_native.cascade(query, kc, vc, *args, 0.125, out)
        assert out.isnan().all()
    with pytest.raises(ValueError, match="fp32"):
        cpu_native.cascade(query.bfloat16(), kc.bfloat16(), vc.bfloat16(), *good, 0.125, out.bfloat16())
    zero_len = nc.prefix_lens.clone()
    zero_len[0] = 0
    with pytest.raises(ValueError, match="empty"):
        cpu_native.cascade(query, kc, vc, *good[:4], zero_len, good[5], 0.125, out)
