"""The scheduling policy, as pure functions of the queues and the last block-manager reply: which
waiting sequences to admit, which swapped ones to bring back, the worker batches (decode
tokens first, then prefill chunks within the token budget: chunked prefill) and how many decode
steps each sequence of a decode-only batch runs in one worker call (multi-step decode).

Pure: no gRPC, no protobuf, no clock, and nothing it is given is changed. The scheduler
(frontend/engine/scheduler.py) owns the queues and applies what these functions choose;
tests/frontend/engine/test_policy.py checks their limits without any server.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from pagedkv.frontend.engine.admission import PrefixProgress
from pagedkv.frontend.engine.remote_table import PoolView, growth_blocks
from pagedkv.frontend.engine.types import Seq, SeqStatus
from pagedkv.kv_capacity import blocks_for_tokens
from pagedkv.watermark import admission_room


@dataclass(slots=True, frozen=True)
class Limits:
    """The engine's batch limits and the pool's geometry (EngineConfig + the manager's Config)."""

    max_num_seqs: int
    max_batch_tokens: int
    block_size: int
    watermark: int
    prefix_caching: bool
    kv_groups: int = 1  # the pool's KV-cache groups: an Allocate takes a prompt's blocks in each


def swap_ins(swapped: Iterable[Seq], num_running: int, limits: Limits) -> list[Seq]:
    """Swapped sequences to bring back, oldest first, while max_num_seqs leaves room."""
    return list(itertools.islice(swapped, max(0, limits.max_num_seqs - num_running)))


def admissions(
    waiting: Iterable[Seq],
    running: Sequence[Seq],
    finishing: Sequence[Seq],
    grow: Sequence[Seq],
    num_swap_in: int,
    pool: PoolView,
    limits: Limits,
    finished_prefixes: Iterable[tuple[list[int], int, int]] = (),
) -> tuple[list[Seq], int]:
    """Waiting sequences to allocate in this Step, and how many were held back: FIFO within
    max_num_seqs (an n > 1 request takes n places at once) and the blocks the last reply said are
    available above the watermark (without hits; the head is always tried). With prefix caching,
    a request whose prefix one of this engine's sequences is still computing waits for it
    (frontend/engine/admission.py); ``finished_prefixes`` are (tokens, computed, prefix_cache_drops when
    recorded) hints of what finished sequences committed."""
    bs = limits.block_size
    room = limits.max_num_seqs - len(running) - num_swap_in
    # Blocks the growing sequences take first (their tokens past the blocks they hold).
    budget = admission_room(pool.available - growth_blocks(grow, bs), limits.watermark)
    out: list[Seq] = []
    held = 0
    progress: PrefixProgress | None = None
    for seq in waiting:
        width = seq.width
        need = blocks_for_tokens(len(seq.tokens), bs) * limits.kv_groups
        if width > room or (out and need > budget):
            break
        if limits.prefix_caching:
            if progress is None:
                progress = PrefixProgress(bs)
                for s in itertools.chain(running, finishing):
                    progress.add(s.tokens, s.num_computed)
                for tokens, computed, drops in finished_prefixes:
                    if drops == pool.prefix_cache_drops:  # nothing left the cache since
                        progress.add(tokens, computed)
            # One that takes no hit (prompt logprobs) gains nothing by waiting.
            if seq.reads_prefix_cache and progress.should_hold(seq.tokens):
                held += 1
                continue
            progress.add(seq.tokens, 0)  # its hits are unknown until the reply
        out.append(seq)
        room -= width
        budget -= need
    return out, held


def grants(running: Sequence[Seq], spare: int, limits: Limits, ahead_tokens: int) -> list[Seq]:
    """Running sequences to grant their next block ahead in a Step made anyway, at most ``spare``:
    those whose held blocks have room for fewer than ``ahead_tokens`` more tokens and that will
    compute a token past them (the last token a sequence draws is never computed), nearest the
    boundary first. Not a sequence sharing its tail (its next append copies on write, in a Step
    of its own), one that waits for its parent's prefill, nor a beam (a fork of it would not
    share the block ahead, where its last tokens' KV would be).
    A sequence whose tokens have passed into its block granted ahead may have the next one: the
    Step's appends (before its grants) make that block a table entry."""
    if ahead_tokens <= 0 or spare <= 0:
        return []
    bs = limits.block_size
    out: list[tuple[int, Seq]] = []
    for s in running:
        b = s.blocks
        if b.tail_shared or s.awaiting_parent or s.is_beam:
            continue
        held = max(len(b.table), blocks_for_tokens(len(s.tokens), bs))  # after this Step's appends
        if b.ahead is not None and held == len(b.table):
            continue  # its block ahead is still ahead
        room = held * bs - len(s.tokens)
        left = s.request.max_tokens - len(s.completion.token_ids)
        if room < ahead_tokens and left - 1 > room:  # tokens it may still compute past its own
            out.append((room, s))
    out.sort(key=lambda x: x[0])
    return [s for _, s in out[:spare]]


def batches(
    running: Sequence[Seq],
    limits: Limits,
    *,
    separate_budgets: bool = False,
    num_workers: int = 1,
    prefill_busy: bool = False,
) -> tuple[list[tuple[Seq, int]], list[tuple[Seq, int]]]:
    """(sequence, number of tokens to compute) for this iteration: the decode batch and the
    prefill chunks. ``separate_budgets``: each gets max_batch_tokens (they run on different
    workers); else they share it, decode first. ``num_workers`` mixed workers split the iteration,
    so the budget is that many times max_batch_tokens, and no chunk exceeds max_batch_tokens
    (one sequence's chunk runs on one worker). Sequences whose prefill is in flight (PREFILLING)
    wait, and with ``prefill_busy`` (the prefill pipeline has a chunk in flight) no prefill is planned.
    A sequence with proposals (``Seq.proposed``, speculative decoding) decodes its last token and
    its proposals in one pass."""
    budget = limits.max_batch_tokens * num_workers
    decode = [
        s
        for s in running
        if s.status is SeqStatus.RUNNING
        and s.num_computed == len(s.tokens) - 1 - s.proposed
        and s.blocks.fits(len(s.tokens), limits.block_size)
        and not s.awaiting_parent
    ]
    decode_batch = [(s, 1 + s.proposed) for s in decode[:budget]]
    budget = budget if separate_budgets else budget - sum(k for _, k in decode_batch)
    if separate_budgets and prefill_busy:
        return decode_batch, []
    batch: list[tuple[Seq, int]] = []
    for s in running:
        if (
            s.status is not SeqStatus.RUNNING
            or s.needs_slot
            or s.awaiting_parent
            or s.proposed
            or budget <= 0
        ):
            continue
        remaining = len(s.tokens) - s.num_computed
        if remaining <= 1:
            continue
        chunk = min(remaining, budget, limits.max_batch_tokens)
        batch.append((s, chunk))
        budget -= chunk
    return decode_batch, batch


def decode_steps(batch: Sequence[tuple[Seq, int]], want: int, block_size: int) -> list[int] | None:
    """Multi-step decode (EngineConfig.decode_steps): how many decode steps each sequence of
    ``batch`` runs in one worker call, each next one on the token the last one drew; None: one.

    Only a batch of decode tokens alone goes (a prefill chunk in it would be held up ``want``
    times as long), and in it each sequence goes as far as ``want``, its max_tokens and the blocks
    it holds allow (the steps write their KV there before any Step appends a slot for them).
    A sequence whose next token needs state only the engine keeps goes one step: a grammar's mask,
    the penalties' history, a tail shared with a fork (its next write copies on write, in a Step),
    a beam's (its request decides it).
    Why: an iteration's fixed cost (the block-manager plan, the worker call's transport, the
    engine's own work) is then paid once for several tokens; with one sequence decoding it is a
    tenth of a step on a CPU and more on a GPU. The cost: tokens reach the caller that many at a
    time, and a request arriving meanwhile waits for the call, so the engine asks only when no
    sequence waits for admission (Scheduler.decode_steps). A sequence verifying proposals
    (speculative decoding) goes its one pass beside the others' steps."""
    if want <= 1 or not batch or any(k != 1 + s.proposed for s, k in batch):
        return None
    out = []
    for s, _ in batch:
        opts = s.request.sampling
        if (
            s.proposed
            or s.draft_tokens
            or opts.grammar is not None
            or opts.penalized
            or s.blocks.tail_shared
            or any(c.awaiting_parent for c in s.children)
            or s.is_beam
        ):
            out.append(1)
            continue
        room = s.blocks.held * block_size - s.num_computed  # positions its held blocks have left
        left = s.request.max_tokens - len(s.completion.token_ids)
        out.append(max(1, min(want, room, left)))
    return out if any(n > 1 for n in out) else None
