"""Property-based test of the allocator against a model of what the cache holds.

The model plays the data plane: it keeps the content of every physical block
(written when the manager hands out a fresh block, copied when the manager
returns a copy-on-write op) and each sequence's logical tokens. After every
operation, reading a sequence through its block table must give back exactly
its tokens. That one check catches a wrong prefix hit, a missing or misdirected
copy-on-write, a block handed to two sequences, and a write into a shared block.
The structural invariants (ref counts = table occurrences; free + cached +
referenced = total, disjoint, and the rest in core/invariants.py) are checked
by `check_invariants` each step.

Commits are modelled the way an engine works: allocating or appending
reserves slots but writes nothing; `compute` writes a sequence's pending
tokens (a worker step); `commit` tells the manager up to where KV was written.
A block granted ahead is used the way the engine uses it: `write_ahead`
writes new tokens past the sequence's slots, into its private tail and the
granted block, before appending them; the append must then hand out that very
block, so the tokens read back.
A prefix hit on a block whose KV was never written reads back None instead of
the prompt, so "a hit never points at an uncommitted block" is checked on
every Allocate.

`KV_GROUPS` runs the same machine over several KV-cache groups
(core/kv_groups.py): each group's table is written and read back, a worker
step checks that every window group still holds the window of every position
it computes, and every group's hit blocks must hold the prompt.
"""

from __future__ import annotations

import copy
from array import array

import hypothesis.strategies as st
import pytest
from hypothesis import settings
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from pagedkv.block_manager_svc.core import (
    AlreadyExists,
    BlockManager,
    CoreConfig,
    FailedPrecondition,
    InvalidArgument,
    NotFound,
    ResourceExhausted,
    StepBatch,
)
from pagedkv.block_manager_svc.core.invariants import check_invariants
from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup

BS = 2
NUM_BLOCKS = 10
NAMES = st.sampled_from([f"s{i}" for i in range(6)])
# A tiny alphabet so that prompts share prefixes and the cache gets hits.
TOKEN = st.integers(0, 1)


class AllocatorMachine(RuleBasedStateMachine):
    KV_GROUPS: tuple[KVGroup, ...] = ONE_GROUP
    NUM_BLOCKS = NUM_BLOCKS

    def __init__(self) -> None:
        super().__init__()
        self.bm = BlockManager(
            CoreConfig(
                num_gpu_blocks=self.NUM_BLOCKS, block_size=BS, preemption_mode="off", kv_groups=self.KV_GROUPS
            )
        )
        self.tokens: dict[str, list[int]] = {}  # the model: each sequence's tokens
        self.computed: dict[str, int] = {}  # leading tokens whose KV was written (by it or a sharer)
        self.phys: dict[int, list[int | None]] = {}  # what each physical block holds
        self.ahead: dict[str, int] = {}  # blocks granted ahead, as the grants answered

    # --- the model's data plane -------------------------------------------------
    def _tables(self, seq_id: str) -> list[tuple[int, list[int], KVGroup]]:
        """(first block index, table, group) for each KV group of a running sequence."""
        seq = self.bm.seqs[seq_id]
        n = len(seq.block_ids)
        out = [(0, seq.block_ids, self.KV_GROUPS[0])]
        for g, table in enumerate(seq.kv_tables, 1):
            out.append((n - len(table), table, self.KV_GROUPS[g]))
        return out

    def _write(self, seq_id: str, start: int) -> None:
        """Write seq's tokens from position `start` into its blocks, like a worker (every group's
        layers). Computing a position reads its window: a window group must still hold it.

        A block shared by fork siblings may be written (the engine prefills the
        parent's prompt once) only where every sharer has the same token."""
        toks = self.tokens[seq_id]
        for pos in range(start, len(toks)):
            for first, table, group in self._tables(seq_id):
                assert first <= group.first_live(pos, BS), f"{seq_id} released the window of {pos}"
                block = table[pos // BS - first]
                if self.bm.pool.ref_counts[block] > 1:
                    for other in self.bm.seqs:
                        for o_first, o_table, _ in self._tables(other):
                            i = pos // BS - o_first
                            if 0 <= i < len(o_table) and o_table[i] == block:
                                theirs = self.tokens[other]
                                assert pos >= len(theirs) or theirs[pos] == toks[pos], (
                                    f"write into shared block {block}"
                                )
                slot = self.phys.setdefault(block, [None] * BS)
                slot[pos % BS] = toks[pos]
        self.computed[seq_id] = len(toks)

    def _apply_copies(self, copies: list[tuple[int, int]]) -> None:
        for src, dst in copies:  # a block not computed yet copies as empty slots
            self.phys[dst] = list(self.phys.get(src, [None] * BS))

    def _snapshot(self) -> object:
        pool = self.bm.pool
        return copy.deepcopy(
            (
                {k: (list(s.block_ids), s.kv_tables, s.num_tokens) for k, s in self.bm.seqs.items()},
                list(pool.ref_counts),
                sorted(pool.free_list),
                dict(pool.index),
                self.bm.stats(),
            )
        )

    # --- rules -----------------------------------------------------------------
    @rule(seq_id=NAMES, prompt=st.lists(TOKEN, min_size=1, max_size=3 * BS), with_ids=st.booleans())
    def allocate(self, seq_id: str, prompt: list[int], with_ids: bool) -> None:
        before = self._snapshot()
        try:
            r = self.bm.allocate(seq_id, len(prompt), prompt if with_ids else None)
        except AlreadyExists:
            assert seq_id in self.tokens
            assert self._snapshot() == before
            return
        except ResourceExhausted:
            assert self._snapshot() == before
            return
        assert seq_id not in self.tokens
        assert r.num_cached_tokens % BS == 0 and r.num_cached_tokens < len(prompt)
        if not with_ids:
            assert r.num_cached_tokens == 0
        self.tokens[seq_id] = list(prompt)
        # Hit blocks must already hold exactly these tokens, in every group: check, don't write.
        for first, table, _ in self._tables(seq_id):
            for i in range(first, r.num_cached_tokens // BS):
                assert self.phys.get(table[i - first]) == prompt[i * BS : (i + 1) * BS], (
                    "hit on unwritten or wrong KV"
                )
        self.computed[seq_id] = r.num_cached_tokens

    @rule(seq_id=NAMES, new=st.lists(TOKEN, min_size=1, max_size=BS + 1), with_ids=st.booleans())
    def append(self, seq_id: str, new: list[int], with_ids: bool) -> None:
        before = self._snapshot()
        table = list(self.bm.seqs[seq_id].block_ids) if seq_id in self.bm.seqs else []
        try:
            r = self.bm.append(seq_id, len(new), new if with_ids else None)
        except NotFound:
            assert seq_id not in self.tokens
            assert self._snapshot() == before
            return
        except ResourceExhausted:
            assert self._snapshot() == before
            return
        self._apply_copies(r.ops.copies)
        self._grown(seq_id, table, self.bm.seqs[seq_id].block_ids)
        self.tokens[seq_id].extend(new)

    def _grown(self, seq_id: str, before: list[int], after: list[int]) -> None:
        """The append grew ``seq_id`` from table ``before`` to ``after``: its first new block is the
        one granted ahead, if it held one (which is then spent)."""
        if len(after) > len(before) and seq_id in self.ahead:
            assert after[len(before)] == self.ahead.pop(seq_id), "the append skipped the block granted ahead"

    @rule(seq_id=NAMES)
    def grant(self, seq_id: str) -> None:
        before = self._snapshot()
        try:
            b = self.bm.grant(seq_id)
        except NotFound:
            assert seq_id not in self.tokens
            assert self._snapshot() == before
            return
        except ResourceExhausted:
            assert seq_id not in self.ahead
            assert self._snapshot() == before
            return
        except FailedPrecondition:
            assert len(self.KV_GROUPS) > 1  # one block ahead is one table's
            assert self._snapshot() == before
            return
        assert self.ahead.setdefault(seq_id, b) == b, "a second grant gave another block"
        assert b not in self.bm.seqs[seq_id].block_ids and self.bm.pool.ref_counts[b] == 1
        self.phys[b] = [None] * BS  # a fresh block holds nothing yet

    @precondition(lambda self: bool(self.ahead))
    @rule(data=st.data())
    def write_ahead(self, data: st.DataObject) -> None:
        """The engine computes new tokens before appending them: into the free slots of its private
        tail, then the granted block; then it appends them (with their ids or not)."""
        seq_id = data.draw(st.sampled_from(sorted(self.ahead)))
        seq = self.bm.seqs[seq_id]
        toks = self.tokens[seq_id]
        if self.computed[seq_id] != len(toks):
            return  # the engine computes a sequence's pending tokens first
        room = len(seq.block_ids) * BS - len(toks)
        if room and self.bm.pool.ref_counts[seq.block_ids[-1]] > 1:
            return  # a shared tail's appends never wait (they copy on write)
        new = data.draw(st.lists(TOKEN, min_size=1, max_size=room + BS))
        table = [*seq.block_ids, self.ahead[seq_id]]
        for pos, t in enumerate(new, start=len(toks)):
            self.phys.setdefault(table[pos // BS], [None] * BS)[pos % BS] = t
        before_table = list(seq.block_ids)
        r = self.bm.append(seq_id, len(new), new if data.draw(st.booleans()) else None)
        assert not r.ops.copies and not r.preempted
        self._grown(seq_id, before_table, self.bm.seqs[seq_id].block_ids)
        toks.extend(new)
        self.computed[seq_id] = len(toks)

    @rule(parent=NAMES, child=NAMES)
    def fork(self, parent: str, child: str) -> None:
        before = self._snapshot()
        try:
            blocks = self.bm.fork(parent, child)
        except (NotFound, AlreadyExists):
            assert parent not in self.tokens or child in self.tokens
            assert self._snapshot() == before
            return
        assert blocks == self.bm.seqs[parent].block_ids
        self.tokens[child] = list(self.tokens[parent])
        self.computed[child] = self.computed[parent]

    @rule(seq_id=NAMES)
    def free(self, seq_id: str) -> None:
        try:
            self.bm.free(seq_id)
        except NotFound:
            assert seq_id not in self.tokens
            return
        self.ahead.pop(seq_id, None)
        del self.tokens[seq_id]
        del self.computed[seq_id]

    @rule(seq_id=NAMES)
    def compute(self, seq_id: str) -> None:
        """A worker step: the sequence's pending tokens get their KV."""
        if seq_id in self.tokens:
            self._write(seq_id, self.computed[seq_id])

    @rule(seq_id=NAMES, back=st.integers(0, BS + 1), over=st.booleans())
    def commit(self, seq_id: str, back: int, over: bool) -> None:
        """Commit what was computed (or a bit less); committing past the end is refused."""
        if seq_id not in self.tokens:
            with pytest.raises(NotFound):
                self.bm.commit(seq_id, 1)
            return
        if over:
            before = self._snapshot()
            with pytest.raises(InvalidArgument):
                self.bm.commit(seq_id, len(self.tokens[seq_id]) + 1)
            assert self._snapshot() == before
            return
        self.bm.commit(seq_id, max(self.computed[seq_id] - back, 0))

    @rule(data=st.data())
    def step(self, data: st.DataObject) -> None:
        names = sorted(self.tokens) + ["ghost"]
        appends = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=4))
        frees = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=2))
        appends = [s for s in appends if s not in frees]
        new = data.draw(st.lists(TOKEN, min_size=len(appends), max_size=len(appends)))
        commits = [s for s in sorted(self.tokens) if data.draw(st.booleans())]
        grants = data.draw(st.lists(st.sampled_from(names), unique=True, max_size=3))
        tables = {s: list(self.bm.seqs[s].block_ids) for s in appends if s in self.bm.seqs}
        r = self.bm.step(
            StepBatch(
                append_seq_ids=appends,
                append_token_ids=array("I", new),
                free_seq_ids=frees,
                commit_seq_ids=commits,
                commit_num_computed_tokens=[self.computed[s] for s in commits],
                grant_seq_ids=grants,
            )
        )
        assert not r.commit_errors
        failed_frees = {e.seq_id for e in r.free_errors}
        for s in frees:
            if s in failed_frees:
                assert s not in self.tokens
            else:
                self.ahead.pop(s, None)
                del self.tokens[s]
                del self.computed[s]
        self._apply_copies(r.ops.copies)
        failed = {e.index for e in r.append_errors}
        for i, s in enumerate(appends):
            if i in failed:
                continue
            self._grown(s, tables[s], self.bm.seqs[s].block_ids)
            self.tokens[s].append(new[i])
        refused = {e.index for e in r.grant_errors}
        assert r.grant_index == [j for j in range(len(grants)) if j not in refused]
        for j, b in zip(r.grant_index, r.grant_block_ids, strict=True):
            if self.ahead.setdefault(grants[j], b) != b:
                raise AssertionError("a second grant gave another block")
            self.phys.setdefault(b, [None] * BS)
        for e in r.grant_errors:
            assert (
                e.seq_id == "ghost"
                or e.seq_id in frees
                or self.bm.pool.num_available == 0
                or len(self.KV_GROUPS) > 1
            ), e

    @precondition(lambda self: bool(self.tokens))
    @rule()
    def free_everything(self) -> None:
        for s in list(self.tokens):
            self.bm.free(s)
        self.ahead.clear()
        self.tokens.clear()
        self.computed.clear()
        st_ = self.bm.stats()
        assert st_.num_used_blocks == 0
        assert st_.num_free_blocks + st_.num_cached_blocks == self.NUM_BLOCKS
        assert not any(self.bm.pool.ref_counts)

    # --- invariants --------------------------------------------------------------
    @invariant()
    def structure_is_consistent(self) -> None:
        check_invariants(self.bm)
        assert set(self.bm.seqs) == set(self.tokens)

    @invariant()
    def every_sequence_reads_back_its_tokens(self) -> None:
        """Every computed token reads back through the block table (each group's, from its
        first live block on)."""
        for s, toks in self.tokens.items():
            seq = self.bm.seqs[s]
            assert seq.num_tokens == len(toks)
            toks = toks[: self.computed[s]]
            for first, table, _ in self._tables(s):
                read = []
                for pos in range(first * BS, len(toks)):
                    read.append(self.phys[table[pos // BS - first]][pos % BS])
                assert read == toks[first * BS :], f"{s} reads {read}, expected {toks}"


AllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestAllocator = AllocatorMachine.TestCase


class TwoGroupAllocatorMachine(AllocatorMachine):
    """The same machine over a full group and a 3-token window group."""

    KV_GROUPS = (KVGroup.full(), KVGroup.window(3))
    NUM_BLOCKS = 16


TwoGroupAllocatorMachine.TestCase.settings = settings(max_examples=150, stateful_step_count=40, deadline=None)
TestTwoGroupAllocator = TwoGroupAllocatorMachine.TestCase


# --- the checker itself: each corruption below must be caught --------------------------------
def _committed_core() -> BlockManager:
    bm = BlockManager(CoreConfig(num_gpu_blocks=16, block_size=4, num_cpu_blocks=4, preemption_mode="swap"))
    bm.allocate("a", 13, list(range(13)))
    bm.commit("a", 4)  # registers block 0; blocks 1 and 2 keep their Allocate-time hashes
    bm.fork("a", "b")
    check_invariants(bm)
    return bm


@pytest.mark.parametrize(
    "corrupt, message",
    [
        (lambda bm: bm.pool.ref_counts.__setitem__(bm.seqs["a"].block_ids[0], 1), "ref counts differ"),
        (lambda bm: bm.seqs["a"].pending_hashes.__setitem__(0, b"x" * 16), "kept stale hashes"),
        (lambda bm: bm.seqs["a"].pending_hashes.extend([b"y" * 16] * 3), "more hashes than full pending"),
        (lambda bm: bm.groups[bm.seqs["a"].group].discard("b"), "has 1 members"),
        (lambda bm: bm.pool.free_list.append(bm.pool.free_list[0]), "free list twice"),
        (lambda bm: bm.preemption.victims.discard("b"), None),
    ],
)
def test_the_checker_catches_corruption(corrupt, message) -> None:  # type: ignore[no-untyped-def]
    bm = _committed_core()
    corrupt(bm)
    with pytest.raises(AssertionError, match=message):
        check_invariants(bm)
