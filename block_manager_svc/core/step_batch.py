"""One engine iteration as the core takes it: :class:`StepBatch`, packed parallel arrays.

The wire has two encodings of a Step (packed arrays and AppendRequest
sub-messages) and shapes a client can get wrong; both are the edge's business
(block_manager_svc/handlers.py builds a batch from a StepRequest and rejects a
malformed one with INVALID_ARGUMENT). An in-process caller builds the batch
itself. Either way the core trusts the *shapes* below and checks everything
about *state* (unknown sequences, room, quotas), item by item.
"""

from __future__ import annotations

from array import array
from collections.abc import Sequence
from dataclasses import dataclass


@dataclass(slots=True)
class StepBatch:
    """Everything one Step applies, in the order the core applies it: rollbacks, commits,
    frees, the forks marked ``fork_before_appends``, appends, allocations, the other forks,
    swap-ins, grants. Every item belongs to `tenant` ("" = tenancy off).

    Shapes the builder guarantees: each group's parallel arrays have one entry per item;
    `append_token_ids` holds the ids of the items whose ids are known, concatenated, as
    uint32 (its length is the sum of those items' counts); `alloc_token_ids` likewise for
    every allocation, or is None (ids unknown for all)."""

    commit_seq_ids: Sequence[str] = ()
    commit_num_computed_tokens: Sequence[int] = ()
    free_seq_ids: Sequence[str] = ()
    append_seq_ids: Sequence[str] = ()
    append_num_tokens: Sequence[int] | None = None  # None: one token each
    append_token_ids: array[int] | None = None  # None: no item's ids are known
    append_tokens_known: Sequence[bool] | None = None  # None: all known when append_token_ids is set
    alloc_seq_ids: Sequence[str] = ()
    alloc_num_tokens: Sequence[int] = ()
    alloc_token_ids: array[int] | None = None  # None: ids unknown for every allocation
    alloc_priorities: Sequence[int] | None = None  # None: 0 each
    alloc_salts: Sequence[str] | None = None  # None: "" each
    fork_parent_seq_ids: Sequence[str] = ()
    fork_child_seq_ids: Sequence[str] = ()
    swap_in_seq_ids: Sequence[str] = ()
    tenant: str = ""
    grant_seq_ids: Sequence[str] = ()
    # Rollbacks (speculative decoding): shorten each sequence to its new length, first of all.
    rollback_seq_ids: Sequence[str] = ()
    rollback_num_tokens: Sequence[int] = ()
    # Per allocation: take no prefix-cache hits (prompt logprobs need every position); None: read.
    alloc_skip_prefix_hits: Sequence[bool] | None = None
    # Per fork: apply it before the appends (beam search: the child appends its own next token in
    # the same Step); None: every fork after the allocations.
    fork_before_appends: Sequence[bool] | None = None
