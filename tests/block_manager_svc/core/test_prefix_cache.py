"""Block hashes are content-addressed, chained, and stable across processes."""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys

from pagedkv.block_manager_svc.core.prefix_cache import (
    ROOT_HASH,
    chain_hash,
    chain_hashes,
    encode_tokens,
    root_hash,
)

SNIPPET = (
    "from pagedkv.block_manager_svc.core.prefix_cache import ROOT_HASH, chain_hashes, encode_tokens;"
    "print(chain_hashes(ROOT_HASH, encode_tokens(range(64)), 16, 4)[-1].hex())"
)


def test_hash_is_blake2b_over_parent_and_little_endian_uint32_tokens() -> None:
    tokens = [1, 2, 3, 2**32 - 1]
    expected = hashlib.blake2b(
        ROOT_HASH + b"".join(t.to_bytes(4, "little") for t in tokens), digest_size=16
    ).digest()
    assert chain_hash(ROOT_HASH, encode_tokens(tokens)) == expected


def test_chain_depends_on_every_earlier_block() -> None:
    a = chain_hashes(ROOT_HASH, encode_tokens([1] * 8 + [5] * 4), 4, 3)
    b = chain_hashes(ROOT_HASH, encode_tokens([2] * 4 + [1] * 4 + [5] * 4), 4, 3)
    assert a[2] != b[2]  # same last block, different history
    assert len(set(a)) == 3


def test_salt_separates_hash_spaces() -> None:
    tokens = encode_tokens(range(4))
    assert chain_hash(root_hash(b"tenant-a"), tokens) != chain_hash(root_hash(b"tenant-b"), tokens)


def test_stable_across_processes_and_hash_seeds() -> None:
    here = chain_hashes(ROOT_HASH, encode_tokens(range(64)), 16, 4)[-1].hex()
    for seed in ("0", "12345"):
        out = subprocess.run(
            [sys.executable, "-c", SNIPPET],
            env={**os.environ, "PYTHONHASHSEED": seed},
            capture_output=True,
            text=True,
            check=True,
            timeout=60,
        )
        assert out.stdout.strip() == here


def test_commit_registers_the_hashes_allocate_computed_without_hashing_again(monkeypatch) -> None:  # type: ignore[no-untyped-def]
    from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, manager
    from pagedkv.block_manager_svc.core.prefix_cache import ROOT_HASH, chain_hashes, encode_tokens

    calls = []
    real = manager.chain_hash
    monkeypatch.setattr(manager, "chain_hash", lambda h, t: calls.append(1) or real(h, t))
    bm = BlockManager(CoreConfig(num_gpu_blocks=16, block_size=4, preemption_mode="off"))
    prompt = list(range(13))
    bm.allocate("a", 13, prompt)
    assert len(bm.seqs["a"].pending_hashes) == 3
    bm.commit("a", 13)
    assert calls == [] and bm.seqs["a"].pending_hashes == []  # all three from Allocate
    bm.append("a", 3, [13, 14, 15])
    bm.commit("a", 16)
    assert len(calls) == 1  # the block filled by the append, hashed once, at commit
    want = chain_hashes(ROOT_HASH, encode_tokens(list(range(16))), 4, 4)
    assert [bm.pool.block_hash[b] for b in bm.seqs["a"].block_ids] == want
    bm.check_invariants()
