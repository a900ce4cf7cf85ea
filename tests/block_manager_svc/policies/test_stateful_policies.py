"""Model-checked property test: allocate/append/fork/free/step/swap_in/preempt
under a tiny pool with eviction and preemption; invariants after every rule.
A snapshot round trip (block_manager_svc/records.py) is one more rule: the
machine goes on with the restored core, so every later rule checks that it
behaves as the original would.

The model is each live sequence's token count and whether it is swapped; a
recompute victim leaves the model (the frontend would re-Allocate it). Any
rejected call must leave the observable state unchanged. The machine runs with
one KV-cache group or with two (a full group and a 3-token window group,
core/kv_groups.py): swap, preemption, commits and the snapshot then cover both.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.block_manager_svc import records
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, CoreError, StepBatch
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup
from pagedkv.block_manager_svc.idempotency import DedupeTable
from pagedkv.block_manager_svc.leases import LeaseTable

BS = 2
NAMES = st.sampled_from([f"s{i}" for i in range(7)])
TOKEN = st.integers(0, 2)
KV_GROUPS = st.sampled_from([ONE_GROUP, (KVGroup.full(), KVGroup.window(3))])


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.model: dict[str, tuple[int, bool]] = {}  # seq -> (tokens, swapped)

    @precondition(lambda self: self.bm is None)
    @rule(
        policy=st.sampled_from(["lru", "lru-size"]),
        mode=st.sampled_from(["auto", "swap", "recompute"]),
        cpu=st.integers(0, 6),
        watermark=st.integers(0, 2),
        groups=KV_GROUPS,
    )
    def configure(
        self, policy: str, mode: str, cpu: int, watermark: int, groups: tuple[KVGroup, ...]
    ) -> None:
        self.bm = BlockManager(
            CoreConfig(
                num_gpu_blocks=8 * len(groups),
                block_size=BS,
                num_cpu_blocks=cpu * len(groups),
                eviction_policy=policy,
                preemption_mode=mode,
                watermark_blocks=watermark,
                miss_cost_tokens=4,
                kv_groups=groups,
            )
        )

    def _state(self) -> object:
        bm = self.bm
        assert bm is not None
        return copy.deepcopy(
            (
                {k: (list(s.block_ids), s.kv_tables, s.num_tokens) for k, s in bm.seqs.items()},
                {
                    k: (list(s.cpu_block_ids or ()), s.cpu_kv_tables, s.num_tokens)
                    for k, s in bm.swapped.items()
                },
                list(bm.pool.ref_counts),
                sorted(bm.pool.free_list),
                dict(bm.pool.index),
                list(bm.cpu.ref_counts),
                bm.stats(),
            )
        )

    def _apply_preempted(self, preempted) -> None:  # type: ignore[no-untyped-def]
        for p in preempted:
            tokens, swapped = self.model[p.seq_id]
            assert not swapped and tokens == p.num_tokens
            if p.mode == "swap":
                self.model[p.seq_id] = (tokens, True)
            else:
                del self.model[p.seq_id]

    def _guard(self, call) -> object:  # type: ignore[no-untyped-def]
        before = self._state()
        try:
            return call()
        except CoreError:
            assert self._state() == before, "a rejected call changed the state"
            return None

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=NAMES, prompt=st.lists(TOKEN, min_size=1, max_size=5 * BS), prio=st.integers(-1, 1))
    def allocate(self, seq_id: str, prompt: list[int], prio: int) -> None:
        r = self._guard(lambda: self.bm.allocate(seq_id, len(prompt), prompt, prio))  # type: ignore[union-attr]
        if r is not None:
            assert seq_id not in self.model
            self.model[seq_id] = (len(prompt), False)

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=NAMES, new=st.lists(TOKEN, min_size=1, max_size=2 * BS + 1))
    def append(self, seq_id: str, new: list[int]) -> None:
        r = self._guard(lambda: self.bm.append(seq_id, len(new), new))  # type: ignore[union-attr]
        if r is None:
            return
        assert not self.model[seq_id][1]
        self._apply_preempted(r.preempted)
        assert seq_id not in {p.seq_id for p in r.preempted}
        self.model[seq_id] = (self.model[seq_id][0] + len(new), False)

    @precondition(lambda self: self.bm is not None)
    @rule(parent=NAMES, child=NAMES)
    def fork(self, parent: str, child: str) -> None:
        r = self._guard(lambda: self.bm.fork(parent, child))  # type: ignore[union-attr]
        if r is not None:
            self.model[child] = (self.model[parent][0], False)

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=NAMES, upto=st.integers(0, 12))
    def commit(self, seq_id: str, upto: int) -> None:
        """Commits interleaved with swaps and preemption: check_invariants asserts that every
        referenced prefix-cache block lies in the committed range of a sequence holding it."""
        self._guard(lambda: self.bm.commit(seq_id, upto))  # type: ignore[union-attr]

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=NAMES)
    def free(self, seq_id: str) -> None:
        if self._guard(lambda: self.bm.free(seq_id)) is not None:  # type: ignore[union-attr]
            del self.model[seq_id]

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=NAMES)
    def swap_in(self, seq_id: str) -> None:
        r = self._guard(lambda: self.bm.swap_in(seq_id))  # type: ignore[union-attr]
        if r is not None:
            for sid, blocks in r.tables.items():
                assert self.model[sid][1]
                self.model[sid] = (self.model[sid][0], False)
                assert len(blocks) == -(-self.model[sid][0] // BS)
                assert r.kv_tables.get(sid, []) == self.bm.seqs[sid].kv_tables  # type: ignore[union-attr]

    @precondition(lambda self: self.bm is not None)
    @rule(seq_id=NAMES)
    def preempt(self, seq_id: str) -> None:
        r = self._guard(lambda: self.bm.preempt(seq_id))  # type: ignore[union-attr]
        if r is not None:
            self._apply_preempted(r[0])

    @precondition(lambda self: self.bm is not None)
    @rule(
        ids=st.lists(NAMES, max_size=5, unique=True),
        frees=st.lists(NAMES, max_size=2, unique=True),
        swap_ins=st.lists(NAMES, max_size=2, unique=True),
        k=st.integers(1, BS + 1),
    )
    def step(self, ids: list[str], frees: list[str], swap_ins: list[str], k: int) -> None:
        bm = self.bm
        assert bm is not None
        r = bm.step(
            StepBatch(
                append_seq_ids=ids,
                append_num_tokens=[k] * len(ids),
                free_seq_ids=frees,
                swap_in_seq_ids=swap_ins,
            )
        )
        failed_frees = {e.seq_id for e in r.free_errors}
        for sid in frees:
            if sid not in failed_frees:
                del self.model[sid]
        failed = {e.seq_id for e in r.append_errors}
        preempted = {p.seq_id for p in r.preempted}
        assert not (preempted & (set(ids[: len(ids)]) - failed - preempted))
        # Sequences that grew before a victim was chosen are never victims.
        self._apply_preempted(r.preempted)
        for sid in ids:
            if sid not in failed:
                assert sid not in preempted
                self.model[sid] = (self.model[sid][0] + k, False)
        for res in r.swap_in_results:
            if res is not None:
                for sid in res.tables:
                    self.model[sid] = (self.model[sid][0], False)

    @precondition(lambda self: self.bm is not None)
    @rule()
    def snapshot_and_restore(self) -> None:
        """Through the bytes a snapshot holds; the restored core replaces the original."""
        bm = self.bm
        assert bm is not None
        before = self._state()
        doc = records.decode(records.encode(records.to_record(bm, LeaseTable(), DedupeTable())))
        restored = records.core_from_record(records.config_of(doc.config), doc.core)
        assert records.core_record(restored) == records.core_record(bm)
        self.bm = restored
        assert self._state() == before

    @invariant()
    def consistent(self) -> None:
        bm = self.bm
        if bm is None:
            return
        bm.check_invariants()
        live = {k: (s.num_tokens, False) for k, s in bm.seqs.items()}
        live.update({k: (s.num_tokens, True) for k, s in bm.swapped.items()})
        assert live == self.model


TestPolicies = PolicyMachine.TestCase
TestPolicies.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
