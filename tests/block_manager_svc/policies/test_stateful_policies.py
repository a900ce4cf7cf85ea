"""Model-checked property test: allocate/append/fork/free/step/swap_in/preempt/rollback
under a tiny pool with eviction and preemption; invariants after every rule.
A snapshot round trip (block_manager_svc/records.py) is one more rule: the
machine goes on with the restored core, so every later rule checks that it
behaves as the original would.

The model is each live sequence's token count and whether it is swapped; a
recompute victim leaves the model (the frontend would re-Allocate it). Any
rejected call must leave the observable state unchanged. The machine runs with
one KV-cache group or with two (a full group and a 3-token window group,
core/kv_groups.py): swap, preemption, commits and the snapshot then cover both.

Rollbacks (speculative decoding) interleave with the rest, alone and inside a Step. The
machine also models each sequence's token ids (where known): every block in the prefix
cache that a sequence's table holds wholly within its tokens must be cached under the chain
hash of that sequence's own tokens, so a rolled-back slot that was written again, or a
cached block written past, shows up as a hash that names other tokens.
"""

from __future__ import annotations

import copy

from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.block_manager_svc import records
from pagedkv.block_manager_svc.core import BlockManager, CoreConfig, CoreError, StepBatch
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup, group_key
from pagedkv.block_manager_svc.core.prefix_cache import ROOT_HASH, chain_hashes, encode_tokens
from pagedkv.block_manager_svc.idempotency import DedupeTable
from pagedkv.block_manager_svc.leases import LeaseTable

BS = 2
NAMES = st.sampled_from([f"s{i}" for i in range(7)])
UNKNOWN = -1  # a token id the machine did not send (the step rule's appends)
TOKEN = st.integers(0, 2)
KV_GROUPS = st.sampled_from([ONE_GROUP, (KVGroup.full(), KVGroup.window(3))])


class PolicyMachine(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.bm: BlockManager | None = None
        self.model: dict[str, tuple[int, bool]] = {}  # seq -> (tokens, swapped)
        self.ids: dict[str, list[int]] = {}  # seq -> its token ids (UNKNOWN where not sent)

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
                del self.ids[p.seq_id]

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
            self.ids[seq_id] = list(prompt)

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
        self.ids[seq_id].extend(new)

    @precondition(lambda self: self.bm is not None)
    @rule(parent=NAMES, child=NAMES)
    def fork(self, parent: str, child: str) -> None:
        r = self._guard(lambda: self.bm.fork(parent, child))  # type: ignore[union-attr]
        if r is not None:
            self.model[child] = (self.model[parent][0], False)
            self.ids[child] = list(self.ids[parent])

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
            del self.ids[seq_id]

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
                del self.ids[sid]
        failed = {e.seq_id for e in r.append_errors}
        preempted = {p.seq_id for p in r.preempted}
        assert not (preempted & (set(ids[: len(ids)]) - failed - preempted))
        # Sequences that grew before a victim was chosen are never victims.
        self._apply_preempted(r.preempted)
        for sid in ids:
            if sid not in failed:
                assert sid not in preempted
                self.model[sid] = (self.model[sid][0] + k, False)
                self.ids[sid].extend([UNKNOWN] * k)
        for res in r.swap_in_results:
            if res is not None:
                for sid in res.tables:
                    self.model[sid] = (self.model[sid][0], False)

    @precondition(lambda self: self.bm is not None and any(not s for _, s in self.model.values()))
    @rule(pick=st.integers(0, 6), back=st.integers(1, 2 * BS + 1), new=st.lists(TOKEN, max_size=BS + 1))
    def rollback(self, pick: int, back: int, new: list[int]) -> None:
        """Take back the last `back` tokens (refused below the committed length or to nothing),
        then append `new` (the next proposal)."""
        seq_id = self._running(pick)
        n = self.model.get(seq_id, (back + 1, False))[0] - back
        if self._guard(lambda: self.bm.rollback(seq_id, n)) is not None:  # type: ignore[union-attr]
            assert not self.model[seq_id][1]
            self.model[seq_id] = (n, False)
            del self.ids[seq_id][n:]
        if new:
            self.append(seq_id, new)

    def _running(self, pick: int) -> str:
        """One of the running sequences (the rollback rules pick live ones, so that their
        interleavings with forks and commits come up often)."""
        running = sorted(k for k, (_, swapped) in self.model.items() if not swapped)
        return running[pick % len(running)]

    @precondition(lambda self: self.bm is not None and any(not s for _, s in self.model.values()))
    @rule(pick=st.integers(0, 6))
    def sibling_commits_and_finishes(self, pick: int) -> None:
        """A fork sibling computes and commits everything it shares, then finishes: its blocks
        stay cached while the parent, whose commits lag, may still roll back into them."""
        bm = self.bm
        assert bm is not None
        parent = self._running(pick)
        child = "sibling"  # never live between rules
        if self._guard(lambda: bm.fork(parent, child)) is None:
            return
        bm.commit(child, self.model[parent][0])
        bm.free(child)

    @precondition(lambda self: self.bm is not None)
    @rule(
        backs=st.dictionaries(NAMES, st.integers(0, BS + 1), max_size=3),
        commits=st.dictionaries(NAMES, st.integers(0, 12), max_size=2),
        grow=st.dictionaries(NAMES, st.lists(TOKEN, min_size=1, max_size=BS + 1), max_size=3),
    )
    def speculative_step(
        self, backs: dict[str, int], commits: dict[str, int], grow: dict[str, list[int]]
    ) -> None:
        """One verification round trip: rollbacks, then commits, then appends of the next
        proposals with their token ids, all in one Step."""
        bm = self.bm
        assert bm is not None
        lengths = {sid: self.model.get(sid, (b + 1, False))[0] - b for sid, b in backs.items()}
        ids = list(grow)
        r = bm.step(
            StepBatch(
                rollback_seq_ids=list(lengths),
                rollback_num_tokens=list(lengths.values()),
                commit_seq_ids=list(commits),
                commit_num_computed_tokens=list(commits.values()),
                append_seq_ids=ids,
                append_num_tokens=[len(grow[sid]) for sid in ids],
                append_token_ids=encode_tokens([t for sid in ids for t in grow[sid]]),
            )
        )
        rolled_back = set(lengths) - {e.seq_id for e in r.rollback_errors}
        for sid in rolled_back:
            self.model[sid] = (lengths[sid], False)
            del self.ids[sid][lengths[sid] :]
        failed = {e.seq_id for e in r.append_errors}
        self._apply_preempted(r.preempted)
        for sid in ids:
            if sid not in failed:
                self.model[sid] = (self.model[sid][0] + len(grow[sid]), False)
                self.ids[sid].extend(grow[sid])

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
        assert self.ids.keys() == self.model.keys()
        for seq_id, seq in bm.seqs.items():
            self._check_cached_content(seq_id, [seq.block_ids, *seq.kv_tables])

    def _check_cached_content(self, seq_id: str, tables: list[list[int]]) -> None:
        """Every prefix-cached block of a sequence that its tokens fill is cached under the
        chain hash of those tokens (the sequence's own KV is what the cache names)."""
        bm = self.bm
        assert bm is not None
        ids = self.ids[seq_id]
        assert len(ids) == self.model[seq_id][0]
        known = len(ids) if UNKNOWN not in ids else ids.index(UNKNOWN)
        want = chain_hashes(ROOT_HASH, encode_tokens(ids[:known]), BS, known // BS)
        n = len(tables[0])
        for g, table in enumerate(tables):
            start = n - len(table)
            for pos, b in enumerate(table, start):
                h = bm.pool.block_hash[b]
                if h is not None and pos < len(want):
                    assert h == group_key(want[pos], g), (
                        f"{seq_id}'s block {pos} (group {g}) names other tokens"
                    )


TestPolicies = PolicyMachine.TestCase
TestPolicies.settings = settings(
    max_examples=150, stateful_step_count=40, deadline=None, suppress_health_check=[HealthCheck.too_slow]
)
