"""The CPU backend (kernels/cpu/attention.py) against the torch reference, through the public wrappers.

Fresh random inputs (never zeros), NaN-poisoned outputs, ragged lengths around block boundaries,
GQA / MQA / MHA, strided layer views of a bigger cache, fp32 + fp16 + bf16 (SDPA does all three on
CPU), and length buckets that really split a batch. Decode and prefill run on both of their paths:
the native kernel (kernels/cpu/native.py; fp16 falls back to buckets inside it) and the gather +
SDPA buckets (``PAGEDKV_CPU_NATIVE=0``).
"""

from __future__ import annotations

import random

import pytest
import torch

from pagedkv import kernels
from pagedkv.kernels import reference
from pagedkv.kernels.cpu import attention as cpu
from pagedkv.kernels.cpu import native as cpu_native
from tests.kernels.cases import (
    assert_close,
    generator,
    make_caches,
    make_paged,
    poisoned_like,
    ragged_lens,
    randn,
)

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU backend cases (CPU tensors)")
DTYPES = [torch.float32, torch.float16, torch.bfloat16]


@pytest.fixture(autouse=True)
def _cpu_backend():  # type: ignore[no-untyped-def]
    with kernels.use_backend("cpu"):
        yield


@pytest.fixture(params=["native", "buckets"])
def cpu_path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Run a test on the native kernel, then on the gather + SDPA buckets."""
    if request.param == "buckets":
        monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")
    elif not cpu_native.available():
        pytest.skip("the native kernels were not built at install (no C compiler then)")
    return str(request.param)


def test_plan_follows_the_path(cpu_path: str) -> None:
    case = make_paged([40, 3, 200], 16, 2, 64, torch.float32, seed=1)
    plan = cpu.plan_decode(case.block_tables, case.seq_lens, 16)
    if cpu_path == "native":
        assert (
            plan.native_tables is not None and plan.native_tables.dtype == torch.int32 and not plan.bucketed
        )
    else:
        assert plan.native_tables is None and plan.bucketed and plan.buckets


def _decode(case, num_heads: int, dtype: torch.dtype, seed: int) -> None:  # type: ignore[no-untyped-def]
    n, d = case.seq_lens.shape[0], case.key_cache.shape[3]
    q = randn((n, num_heads, d), dtype, generator(seed))
    out = poisoned_like(q)
    got = kernels.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, d**-0.5, out=out
    )
    assert got is out
    want = reference.paged_decode_attention(
        q, case.key_cache, case.value_cache, case.block_tables, case.seq_lens, d**-0.5
    )
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 1), (4, 4)])
def test_decode_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, cpu_path: str
) -> None:
    case = make_paged(ragged_lens(16, 150) + [33, 97, 2], 16, num_kv_heads, 64, dtype, seed=num_heads)
    _decode(case, num_heads, dtype, seed=5)


@pytest.mark.parametrize("layout", ["layers", "blocks_outer"])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_decode_strided_caches(layout: str, head_dim: int, cpu_path: str) -> None:
    case = make_paged([5, 64, 300, 17], 16, 2, head_dim, torch.float32, seed=head_dim, layout=layout)
    _decode(case, 8, torch.float32, seed=3)


def test_decode_many_buckets_and_a_zero_length(cpu_path: str) -> None:
    rnd = random.Random(0)
    lens = [rnd.randint(1, 400) for _ in range(40)] + [0]
    buckets = cpu.decode_buckets(lens, 16)
    assert len(buckets) > 2  # the batch really is split
    assert sorted(i for members, _ in buckets for i in members) == list(range(len(lens)))
    for members, nb in buckets:  # no member is cut short, padding stays bounded
        assert all(lens[m] <= nb * 16 for m in members)
        padding = nb * 16 * len(members) - sum(lens[m] for m in members)
        assert padding <= max(cpu.PAD_FRACTION * nb * 16 * len(members), cpu.PAD_TOKENS) or len(members) == 1
    case = make_paged(lens, 16, 2, 64, torch.float32, seed=11)
    _decode(case, 8, torch.float32, seed=12)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize(("num_heads", "num_kv_heads"), [(8, 2), (4, 1), (2, 2)])
def test_prefill_matches_reference(
    dtype: torch.dtype, num_heads: int, num_kv_heads: int, cpu_path: str
) -> None:
    # (seq_len, q_len): whole prompts, chunks after a cached prefix, one token, an empty entry.
    shape = [(40, 40), (70, 23), (16, 1), (33, 0), (129, 17)]
    case = make_paged([s for s, _ in shape], 16, num_kv_heads, 64, dtype, seed=num_heads + 7)
    qsl = torch.tensor(
        [0] + [sum(q for _, q in shape[: i + 1]) for i in range(len(shape))], dtype=torch.int32
    )
    q = randn((int(qsl[-1]), num_heads, 64), dtype, generator(9))
    out = poisoned_like(q)
    got = kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125, out=out
    )
    assert got is out
    want = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125
    )
    assert_close(got, want, dtype)


def _shared_prefix_case(dtype: torch.dtype, seed: int):  # type: ignore[no-untyped-def]
    """Block tables where groups of sequences start with the same physical blocks (prefix hits on
    a system prompt), as the block manager hands them out, plus loners and short sequences."""
    rnd = random.Random(seed)
    # (shared blocks of the group, own lengths past them) per group; the last group is loners.
    groups = [(10, [rnd.randint(1, 90) for _ in range(7)]), (5, [1, 16, 17, 40]), (6, [0])]
    lens, tables, nxt = [], [], 0
    for shared, own in groups:
        prefix = list(range(nxt, nxt + shared))
        nxt += shared
        for extra in own:
            n = shared * 16 + extra
            mine = list(range(nxt, nxt + max(0, -(-n // 16) - shared)))
            nxt += len(mine)
            lens.append(n)
            tables.append(prefix + mine)
    lens += [3, 70, 300]  # loners below and above the sharing threshold
    for n in lens[-3:]:
        tables.append(list(range(nxt, nxt + -(-n // 16))))
        nxt += len(tables[-1])
    width = max(len(t) for t in tables)
    order = torch.randperm(nxt + 5, generator=generator(seed))  # physical ids scattered over the cache
    bt = torch.tensor(
        [[int(order[b]) for b in t] + [0] * (width - len(t)) for t in tables], dtype=torch.int32
    )
    case = make_paged([16] * (nxt + 5), 16, 2, 64, dtype, seed=seed)  # just for caches of nxt + 5 blocks
    return case.key_cache[: nxt + 5], case.value_cache[: nxt + 5], bt, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_with_shared_prefixes_attends_to_them_once_and_matches_reference(
    dtype: torch.dtype, monkeypatch: pytest.MonkeyPatch
) -> None:
    kc, vc, bt, lens = _shared_prefix_case(dtype, seed=41)
    monkeypatch.setattr(cpu, "CASCADE_MIN_SAVED_TOKENS", 0)  # these small groups: the cascade path
    monkeypatch.setenv(cpu_native.ENV_SWITCH, "0")  # the cascade belongs to the bucket path
    plan = cpu.plan_decode(bt, lens, 16)
    # Both groups share all their common blocks (every member keeps at least one token of its own);
    # the lone member of the third group and the loners attend on their own.
    assert sorted(sp.idx.tolist() for sp in plan.shared) == [list(range(7)), [7, 8, 9, 10]]
    assert sorted(sp.ids.numel() for sp in plan.shared) == [5, 10]
    q = randn((lens.shape[0], 8, 64), dtype, generator(42))
    out = poisoned_like(q)
    got = kernels.paged_decode_attention(q, kc, vc, bt, lens, 0.125, out=out)
    want = reference.paged_decode_attention(q, kc, vc, bt, lens, 0.125)
    assert_close(got, want, dtype)


def test_shared_prefix_is_attended_once_only_when_that_saves_enough_tokens() -> None:
    """The cascade costs a call and a merge: it is used only when (members - 1) x shared tokens
    reaches CASCADE_MIN_SAVED_TOKENS; below that the members attend to their whole contexts."""
    lens, tables = [], []
    members = 3
    shared = cpu.CASCADE_MIN_SAVED_TOKENS // ((members - 1) * 16)  # blocks: exactly at the threshold
    for i in range(members):
        tables.append(list(range(shared)) + [shared + i])
        lens.append(shared * 16 + 5)
    assert cpu.shared_prefixes(tables, lens, 16) == [([0, 1, 2], shared)]
    assert cpu.shared_prefixes([t[:-2] + [t[-1]] for t in tables], [n - 16 for n in lens], 16) == []
    assert cpu.shared_prefixes(tables[:2], lens[:2], 16) == []  # one member fewer: half the saving


def test_prefill_buckets_cover_every_chunk_once_with_bounded_padding() -> None:
    rnd = random.Random(4)
    # A burst after a shared cached prompt (short chunks over long contexts), first chunks, one-token chunks.
    seq_lens = [rnd.randint(440, 470) for _ in range(30)] + [400, 512, 37, 16, 90]
    q_lens = [rnd.randint(8, 24) for _ in range(30)] + [400, 100, 37, 1, 0]
    buckets = cpu.prefill_buckets(seq_lens, q_lens, 16)
    assert len(buckets) < 10  # 34 chunks, far fewer calls
    assert sorted(i for members, _, _ in buckets for i in members) == [i for i in range(35) if q_lens[i]]
    for members, nb, rows in buckets:
        assert all(seq_lens[m] <= nb * 16 and q_lens[m] <= rows for m in members)
        padded = nb * 16 * rows * len(members)
        real = sum(seq_lens[m] * q_lens[m] for m in members)
        assert padded - real <= cpu.PREFILL_PAD_FRACTION * padded or len(members) == 1
    assert any(len(members) > 8 for members, _, _ in buckets)  # the burst really shares calls


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_prefill_burst_in_shared_buckets_matches_reference(dtype: torch.dtype, cpu_path: str) -> None:
    rnd = random.Random(8)
    shape = [(rnd.randint(100, 140), rnd.randint(3, 12)) for _ in range(20)] + [(64, 64), (17, 1), (150, 0)]
    assert any(
        len(m) > 4 for m, _, _ in cpu.prefill_buckets([s for s, _ in shape], [q for _, q in shape], 16)
    )
    case = make_paged([s for s, _ in shape], 16, 2, 64, dtype, seed=31)
    qsl = torch.tensor(
        [0] + [sum(q for _, q in shape[: i + 1]) for i in range(len(shape))], dtype=torch.int32
    )
    q = randn((int(qsl[-1]), 8, 64), dtype, generator(32))
    out = poisoned_like(q)
    got = kernels.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125, out=out
    )
    want = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125
    )
    assert_close(got, want, dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("layout", ["plain", "layers", "blocks_outer"])
def test_write_kv_cache_matches_reference(dtype: torch.dtype, layout: str) -> None:
    gen = generator(21)
    kc, vc = make_caches(12, 16, 2, 64, dtype, gen, layout)
    kc2, vc2 = kc.clone(), vc.clone()
    key, value = randn((9, 2, 64), dtype, gen), randn((9, 2, 64), dtype, gen)
    slots = torch.tensor([0, 17, 191, -1, 5, 100, -1, 33, 64], dtype=torch.int64)
    kernels.write_kv_cache(key, value, kc, vc, slots)
    reference.write_kv_cache(key, value, kc2, vc2, slots)
    assert torch.equal(kc, kc2) and torch.equal(vc, vc2)
    assert torch.equal(kc.reshape(-1, 2, 64)[191] if layout == "plain" else kc[11, 15], key[2])


def test_auto_picks_cpu_backend_without_the_interpreter(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.kernels import dispatch

    monkeypatch.setattr(dispatch, "interpret_requested", lambda: False)
    with kernels.use_backend("auto"):
        assert kernels.backend_for(torch.empty(1)) == "cpu"
        assert kernels.backend_for(torch.empty(1, dtype=torch.bfloat16)) == "cpu"


def test_long_shared_prefixes_are_attended_once(cpu_path: str) -> None:
    """Shared prefixes are attended once per group: with the native kernels by their cascade (fp32);
    a call it cannot take (bf16) runs the plain native kernel, which reads a prefix once per member,
    unless the saving reaches NATIVE_MAX_SAVED_TOKENS: then the buckets' cascade. Without the native
    kernels, the buckets' cascade."""
    members, block = 3, 16
    for shared, big in (
        (cpu.NATIVE_MAX_SAVED_TOKENS // ((members - 1) * block), True),
        (cpu.NATIVE_MAX_SAVED_TOKENS // ((members - 1) * block) - 1, False),
    ):
        tables = [list(range(shared)) + [shared + i] for i in range(members)]
        bt = torch.tensor(tables, dtype=torch.int32)
        lens = torch.tensor([shared * block + 3] * members, dtype=torch.int32)
        plan = cpu.plan_decode(bt, lens, block)
        if cpu_path != "native":
            assert plan.native_tables is None and [sp.idx.tolist() for sp in plan.shared] == [[0, 1, 2]]
            continue
        assert plan.cascade is not None and plan.cascade.row_map.tolist() == [0, 1, 2]
        assert plan.cascade.prefix_lens.tolist() == [shared * block]
        assert plan.buckets_first == big and not plan.bucketed
        g = generator(shared)
        kc = randn((shared + members, block, 2, 64), torch.bfloat16, g)
        vc = randn((shared + members, block, 2, 64), torch.bfloat16, g)
        q = randn((members, 8, 64), torch.bfloat16, g)
        got = cpu.paged_decode_attention(q, kc, vc, bt, lens, 0.125, plan=plan)
        assert plan.bucketed == big  # the buckets were built for this call only when the saving is big
        if big:
            assert [sp.idx.tolist() for sp in plan.shared] == [[0, 1, 2]]
        assert_close(got, reference.paged_decode_attention(q, kc, vc, bt, lens, 0.125), torch.bfloat16)


def test_native_prefill_rows_are_causal_decode_queries(cpu_path: str) -> None:
    """Each prefill row is a decode query over its causal prefix: row j of a q_len chunk over
    seq_len tokens attends to seq_len - q_len + j + 1 of them, through its sequence's table."""
    shape = [(70, 23), (16, 1), (33, 0), (5, 5)]
    case = make_paged([n for n, _ in shape], 16, 2, 64, torch.float32, seed=4)
    qsl = torch.tensor([0, 23, 24, 24, 29], dtype=torch.int32)
    plan = cpu.plan_prefill(case.block_tables, qsl, case.seq_lens, 16, 4)
    if cpu_path == "buckets":
        assert plan.native_tables is None and plan.bucketed
        return
    assert plan.native_lens is not None and plan.native_tables is not None and not plan.bucketed
    assert plan.native_lens.tolist() == list(range(48, 71)) + [16] + [1, 2, 3, 4, 5]
    rows_of = [0] * 23 + [1] + [3] * 5
    assert torch.equal(plan.native_tables, case.block_tables.to(torch.int32)[rows_of])


def test_prefill_over_long_contexts_goes_to_the_buckets(
    cpu_path: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Past NATIVE_PREFILL_MAX_CONTEXT (context x head_dim) the rows would re-read a context that
    no longer fits in cache, and past NATIVE_PREFILL_KERNEL_MAX_TOKENS the prefill kernel's scores
    would not fit its scratch: SDPA's buckets take the call, built on demand, same result."""
    monkeypatch.setattr(cpu, "NATIVE_PREFILL_MAX_CONTEXT", 64 * 64)  # contexts over 64 tokens at head_dim 64
    monkeypatch.setattr(cpu, "NATIVE_PREFILL_KERNEL_MAX_TOKENS", 64)
    shape = [(100, 30), (40, 40)]
    case = make_paged([n for n, _ in shape], 16, 2, 64, torch.float32, seed=6)
    qsl = torch.tensor([0, 30, 70], dtype=torch.int32)
    q = randn((70, 8, 64), torch.float32, generator(7))
    plan = cpu.plan_prefill(case.block_tables, qsl, case.seq_lens, 16, 4)
    got = cpu.paged_prefill_attention(
        q,
        case.key_cache,
        case.value_cache,
        case.block_tables,
        qsl,
        case.seq_lens,
        0.125,
        out=poisoned_like(q),
        plan=plan,
    )
    assert plan.bucketed and plan.buckets
    want = reference.paged_prefill_attention(
        q, case.key_cache, case.value_cache, case.block_tables, qsl, case.seq_lens, 0.125
    )
    assert_close(got, want, torch.float32)
