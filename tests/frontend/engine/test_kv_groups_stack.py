"""KV-cache groups through the whole local stack: a random Gemma 3 (6 layers, 2 global and 4 with
an 8-token window: ``full,window:8x2``, derived from the model) served on tables per group.

Prompts several windows long, generated greedily, must equal transformers' tokens; while they
run, each sequence's window tables hold no more than the window's blocks (plus the ones still to
be committed), and the block manager's tables are the engine's; afterwards nothing is held.
The same workload with one flat table (``kv_groups="full"``) gives the same tokens and holds
every block in every layer.
"""

from __future__ import annotations

import pathlib
import random

import pytest

from pagedkv.block_manager_svc.core.kv_groups import KVGroup
from pagedkv.frontend.engine import EngineConfig, GenerationRequest
from pagedkv.frontend.launch.config import StackConfig
from pagedkv.frontend.launch.local_stack import LocalStack
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.worker_svc.geometry import kv_groups_for
from tests.worker_svc.model.test_gemma3 import WINDOW, build_gemma3
from tests.worker_svc.model.test_gemma3_kv_groups import LAYOUT

BLOCK = 4
MAX_TOKENS = 10


@pytest.fixture(autouse=True)
def _reference_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("PAGEDKV_KERNEL_BACKEND", "reference")


def _prompts() -> list[list[int]]:
    rng = random.Random(7)
    system = [rng.randrange(1, 120) for _ in range(13)]  # shared: prefix-cache hits in every group
    return [system + [rng.randrange(1, 120) for _ in range(rng.randint(20, 30))] for _ in range(4)]


def _run(
    model: str, kv_groups: str, engine_config: EngineConfig | None = None, draft: str | None = None
) -> tuple[list[list[int]], list[tuple[int, list[int]]], dict[str, int]]:
    """Each request's tokens, (tokens, window table lengths) at every iteration, final counts."""
    cfg = StackConfig(
        model=model, device="cpu", dtype="float32", block_size=BLOCK, num_gpu_blocks=200, kv_groups=kv_groups,
        speculative_model=draft,
    )  # fmt: skip
    seen: list[tuple[int, list[int]]] = []
    with LocalStack(cfg) as st:
        engine = st.engine(engine_config or EngineConfig(max_batch_tokens=16, max_num_seqs=3))
        bm = st.block_manager.servicer._core  # noqa: SLF001 - white-box check
        for i, p in enumerate(_prompts()):
            engine.add_request(GenerationRequest(f"r{i}", p, max_tokens=MAX_TOKENS))
        while engine.has_work():
            engine.step()
            for s in engine.running_sequences():
                b = s.blocks
                if not b.table:
                    continue
                seen.append((b.committed, [len(t) for t in b.groups]))
                held = bm.block_table(s.seq_id)  # the manager's tables are the engine's
                assert held.block_ids == b.table and held.kv_block_ids == b.groups, s.seq_id
            bm.check_invariants()
        outs = [engine.outputs[f"r{i}"] for i in range(4)]
        stats = bm.stats()
        counts = {"sequences": stats.num_sequences, "used": stats.num_used_blocks}
        if engine.stats.spec_passes:
            counts["rejected"] = engine.stats.spec_proposed - engine.stats.spec_accepted
            counts["accepted"] = engine.stats.spec_accepted
        engine.close()
    return [o.completions[0].token_ids for o in outs], seen, counts


def test_gemma3_on_per_group_tables_matches_transformers(tmp_path: pathlib.Path) -> None:
    hf = build_gemma3(tmp_path / "hf", seed=4, **LAYOUT)
    assert kv_groups_for(str(hf.path)) == f"full,window:{WINDOW}x2"
    got, seen, counts = _run(str(hf.path), "auto")
    assert got == [hf.greedy(p, MAX_TOKENS) for p in _prompts()]
    assert counts == {"sequences": 0, "used": 0}
    # A window table: the blocks from the committed count's window on, and any not yet committed.
    bound = KVGroup.window(WINDOW).max_live_blocks(BLOCK)
    assert bound is not None
    assert seen and all(len(w) == 2 for _, w in seen)
    for committed, windows in seen:
        assert max(windows) <= bound + blocks_for_tokens(80, BLOCK) - committed // BLOCK
    # Once a sequence committed well past its window, its window tables stay short.
    long = [w for c, w in seen if c >= 40]
    assert long and all(max(w) <= bound + 1 for w in long)
    flat, flat_seen, _ = _run(str(hf.path), "full")
    assert flat == got and all(w == [] for _, w in flat_seen)


def test_speculative_rollbacks_shorten_every_groups_table(tmp_path: pathlib.Path) -> None:
    """Rejected proposals' slots are rolled back in every group, the engine's window tables too
    (checked against the manager's at every iteration); the tokens are plain decoding's."""
    from pagedkv.frontend.engine.speculate import SpeculativeConfig

    hf = build_gemma3(tmp_path / "hf", seed=4, **LAYOUT)
    spec = SpeculativeConfig(num_speculative_tokens=3, prompt_lookup_min=1, max_num_seqs=4)
    got, _, counts = _run(str(hf.path), "auto", EngineConfig(max_batch_tokens=16, speculative=spec))
    assert counts.get("rejected", 0) > 0, "nothing was rolled back"
    assert got == [hf.greedy(p, MAX_TOKENS) for p in _prompts()]


def test_gemma3_as_its_own_draft_on_per_group_tables(tmp_path: pathlib.Path) -> None:
    """A draft model beside a model served on per-group tables: the draft's cache (its layers in one
    table, its windows applied by the kernels) follows group 0's blocks, so the model as its own
    draft has every proposal kept, and the tokens are transformers'."""
    from pagedkv.frontend.engine.speculate import SpeculativeConfig

    hf = build_gemma3(tmp_path / "hf", seed=4, **LAYOUT)
    spec = SpeculativeConfig(method="draft_model", num_speculative_tokens=3, max_num_seqs=4)
    got, _, counts = _run(
        str(hf.path), "auto", EngineConfig(max_batch_tokens=16, speculative=spec), str(hf.path)
    )
    assert got == [hf.greedy(p, MAX_TOKENS) for p in _prompts()]
    assert counts["accepted"] > 0 and counts["rejected"] == 0
    assert (counts["sequences"], counts["used"]) == (0, 0)
