"""Gemma 3 with KV-cache groups (worker_svc/model/kv_layout.py): one block table per group, a
window group's table only its window's blocks, released blocks -1 in the tables the worker runs.

A random model of 6 layers (2 global, 4 with an 8-token window) is 3 groups of 2 layers: the
block manager's core (``--kv-groups full,window:8x2``) holds the tables and releases window
blocks at each Commit; the cache starts as NaN, and two sequences run together so blocks one
releases are written by the other. Greedy tokens must equal transformers'.
"""

from __future__ import annotations

import pathlib

import pytest
import torch

from pagedkv.block_manager_svc.core import BlockManager, CoreConfig
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup
from pagedkv.worker_svc.model.config import ModelConfig, load_model_config
from pagedkv.worker_svc.model.kv_layout import kv_layout, model_kv_groups
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import InvalidStep, ModelRunner, SequenceRequest
from tests.worker_svc.model.test_gemma3 import LONG, WINDOW, build_gemma3

BLOCK = 4
S, F = "sliding_attention", "full_attention"
LAYOUT = dict(num_hidden_layers=6, layer_types=[S, S, F, S, S, F], query_pre_attn_scalar=24)
GROUPS = (KVGroup.full(), KVGroup.window(WINDOW), KVGroup.window(WINDOW))


def test_layer_groups_from_the_layer_types() -> None:
    cfg = ModelConfig(128, 64, 128, 6, 4, 2, 32, layer_windows=(8, 8, None, 8, 8, None))
    assert model_kv_groups(cfg) == GROUPS
    layout = kv_layout(cfg, GROUPS)
    assert layout.layer_group == (1, 1, 0, 2, 2, 0) and layout.layer_slot == (0, 1, 0, 0, 1, 1)
    assert layout.layers_per_block == 2
    flat = kv_layout(cfg, ONE_GROUP)
    assert flat.layers_per_block == 6 and flat.layer_slot == tuple(range(6))
    with pytest.raises(ValueError, match="do not fit model"):
        kv_layout(cfg, (KVGroup.full(), KVGroup.window(16), KVGroup.window(16)))
    # Gemma 3 270M: every 6th of 18 layers global.
    gemma = ModelConfig(
        128, 64, 128, 18, 4, 1, 32, layer_windows=tuple(None if i % 6 == 5 else 512 for i in range(18))
    )
    assert model_kv_groups(gemma) == (KVGroup.full(), *[KVGroup.window(512)] * 5)
    assert model_kv_groups(ModelConfig(128, 64, 128, 4, 4, 2, 32)) == ONE_GROUP


def _request(bm: BlockManager, seq_id: str, tokens: list[int], cached: int) -> SequenceRequest:
    t = bm.block_table(seq_id)
    n = len(t.block_ids)
    return SequenceRequest(
        seq_id=seq_id,
        token_ids=tokens,
        block_ids=t.block_ids,
        num_cached_tokens=cached,
        group_tables=[(n - len(ids), ids) for ids in t.kv_block_ids],
    )


def test_grouped_tables_generate_what_transformers_does(tmp_path: pathlib.Path) -> None:
    hf = build_gemma3(tmp_path / "hf", seed=3, **LAYOUT)
    cfg = load_model_config(str(hf.path))
    model = load_model(str(hf.path), cfg, torch.float32, torch.device("cpu"))
    blocks = 40
    shape = (2, 2, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)  # 2 layers per block
    runner = ModelRunner(
        model, torch.full(shape, float("nan")), torch.zeros((2, 2, 0, *shape[3:])), kv_groups=GROUPS
    )
    bm = BlockManager(
        CoreConfig(num_gpu_blocks=blocks, block_size=BLOCK, kv_groups=GROUPS, preemption_mode="off")
    )
    prompts = {"a": LONG, "b": LONG[5:]}
    tokens = {k: list(p) for k, p in prompts.items()}
    for k, p in prompts.items():
        bm.allocate(k, len(p), list(p))
    outs = runner.step([_request(bm, k, p, 0) for k, p in prompts.items()]).outputs
    n_new = 12
    released = 0
    for _ in range(n_new):
        for k, o in zip(prompts, outs, strict=True):
            tokens[k].append(o.token_id)
            bm.commit(k, len(tokens[k]) - 1)  # the KV of every token but the one just drawn
            bm.append(k, 1, [o.token_id])
        reqs = [_request(bm, k, [tokens[k][-1]], len(tokens[k]) - 1) for k in prompts]
        released = max(released, *(first for r in reqs for first, _ in r.group_tables))
        for r in reqs:  # a window table holds its window's blocks: ceil(8 / 4) + 1, plus the new one
            assert all(len(ids) <= WINDOW // BLOCK + 2 for _, ids in r.group_tables)
        outs = runner.step(reqs).outputs
        bm.check_invariants()
    assert released >= 3  # blocks before the window were released (-1 in the worker's tables)
    got = {k: tokens[k][len(p) :] + [outs[i].token_id] for i, (k, p) in enumerate(prompts.items())}
    assert got == {k: hf.greedy(p, n_new + 1) for k, p in prompts.items()}


def test_a_table_starting_after_the_window_or_missing_groups_is_refused(tmp_path: pathlib.Path) -> None:
    hf = build_gemma3(tmp_path / "hf", seed=3, **LAYOUT)
    cfg = load_model_config(str(hf.path))
    model = load_model(str(hf.path), cfg, torch.float32, torch.device("cpu"))
    shape = (2, 2, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim)
    runner = ModelRunner(model, torch.zeros(shape), torch.zeros((2, 2, 0, *shape[3:])), kv_groups=GROUPS)
    ok = dict(seq_id="s", token_ids=[1], block_ids=[0, 1, 2, 3], num_cached_tokens=12)
    # position 12 reads [5, 12]: from block 1 on
    runner.validate([SequenceRequest(**ok, group_tables=[(1, [5, 6, 7]), (1, [8, 9, 10])])], _ops())  # type: ignore[arg-type]
    with pytest.raises(InvalidStep, match="group 2's table starts at block 2"):
        runner.validate([SequenceRequest(**ok, group_tables=[(1, [5, 6, 7]), (2, [9, 10])])], _ops())  # type: ignore[arg-type]
    with pytest.raises(InvalidStep, match="1 group tables, the pool has 3"):
        runner.validate([SequenceRequest(**ok, group_tables=[(0, [5, 6, 7, 8])])], _ops())  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"not \[num_layers=2"):
        ModelRunner(model, torch.zeros((6, *shape[1:])), torch.zeros(0), kv_groups=GROUPS)


def _ops():  # type: ignore[no-untyped-def]
    from pagedkv.worker_svc.model_runner import CacheOpsRequest

    return CacheOpsRequest()
