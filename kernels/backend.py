"""The kernel operations, declared once, and the backends that implement them, by name.

``KernelBackend`` is the contract: the five operations (plus the two optional per-step plans) with
their argument names, order, shapes and meaning. A backend is a module whose functions have exactly
these signatures (mypy checks a module against a Protocol); it receives arguments that
``kernels/checks.py`` has already validated, so it checks nothing itself. The public entry points in
``kernels/__init__.py`` are generated from this class (same signature and docstring), and
``kernels/step.py`` calls a backend directly once a step's metadata was validated.

Adding a backend is one module plus one line in ``MODULES`` (loaded through ``pagedkv/registry.py``).
Which backend runs a call is decided in
``kernels/dispatch.py`` (``resolve``), and only there.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Protocol, cast

import torch

from pagedkv.registry import load as load_registered

# name -> module: imported on first use, so a missing optional dependency (Triton) only matters
# when its backend is chosen.
MODULES: dict[str, str] = {
    "reference": "pagedkv.kernels.reference",  # plain torch, the oracle
    # The CPU fast path: the native C kernels (kernels/cpu/native.py) where built, else
    # length-bucketed gathers + torch's fused SDPA (kernels/cpu/attention.py decides per call).
    "cpu": "pagedkv.kernels.cpu.attention",
    "triton": "pagedkv.kernels.triton_backend",  # Triton kernels: CUDA, or CPU in Triton's interpreter
}

# The operations, in the order they are documented (docs/kernels.md).
OPERATIONS: tuple[str, ...] = (
    "write_kv_cache",
    "paged_decode_attention",
    "paged_prefill_attention",
    "copy_blocks",
    "swap_blocks",
)


class KernelBackend(Protocol):
    """What every backend implements. One layer's cache is ``key_cache``/``value_cache`` of shape
    ``[num_blocks, block_size, num_kv_heads, head_dim]`` (strided views are fine; head_dim must be
    contiguous); a token's slot is ``block_id * block_size + offset``."""

    def write_kv_cache(
        self,
        key: torch.Tensor,
        value: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> None:
        """Write each token's K/V (``[num_tokens, num_kv_heads, head_dim]``) into its cache slot.

        ``slot_mapping[i] = block_id * block_size + offset``; -1 means padding (nothing is written).
        """

    def paged_decode_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        max_seq_len: int | None = None,
        num_splits: int | None = None,
        out: torch.Tensor | None = None,
        plan: object | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Attention of one new token per sequence over its cached context; returns
        ``[num_seqs, num_heads, head_dim]``.

        ``seq_lens[i]`` counts the tokens to attend, including the new one (already written to the
        cache). Optional: ``max_seq_len`` (a host-side upper bound of ``seq_lens``, used to choose the
        split-KV count without reading the device; defaults to the block table's capacity) and
        ``num_splits`` (force the split count, mainly for tests and tuning); backends without split-KV
        ignore both. ``out``: an optional preallocated output (same shape/dtype/device as ``query``),
        filled and returned. ``plan``: what this backend's ``plan_decode`` built for the step.
        ``sliding_window`` (W, None: the whole context): the query at position ``p = seq_len - 1``
        sees only keys ``max(0, p - W + 1) .. p`` (W tokens including itself, as Gemma 3's sliding
        layers); blocks wholly before that are never read, so their block-table entries may hold
        anything (-1 for blocks the block manager released).
        """
        ...

    def paged_prefill_attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        scale: float,
        *,
        max_query_len: int | None = None,
        out: torch.Tensor | None = None,
        plan: object | None = None,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """Causal attention for a ragged batch of query tokens ``[total_q, num_heads, head_dim]``.

        Sequence i's queries are ``query[query_start_loc[i]:query_start_loc[i+1]]``, its LAST ``q_len``
        tokens out of ``seq_lens[i]`` whose K/V are already in the cache. ``max_query_len`` (optional)
        spares the Triton path a device->host read of the longest query run; ``out`` is an optional
        preallocated output like ``query``; ``plan`` what this backend's ``plan_prefill`` built.
        ``sliding_window`` (W, None: causal over everything): query ``i`` of ``q_len``, at position
        ``p = seq_len - q_len + i``, sees keys ``max(0, p - W + 1) .. p``; blocks wholly before the
        window of the sequence's first query are never read (their table entries may hold anything).
        """
        ...

    def copy_blocks(
        self, key_caches: Sequence[torch.Tensor], value_caches: Sequence[torch.Tensor], pairs: torch.Tensor
    ) -> None:
        """Copy block src over block dst (rows of ``pairs`` ``[n, 2]``) in every layer's K and V cache.

        Copy-on-write: destinations must be distinct and not also sources (checked when ``pairs`` is
        on the CPU), since all pairs of all layers run in one launch, in parallel.
        """

    def swap_blocks(
        self,
        src: torch.Tensor | Sequence[torch.Tensor],
        dst: torch.Tensor | Sequence[torch.Tensor],
        pairs: torch.Tensor,
    ) -> None:
        """Copy blocks ``src[s] -> dst[d]`` between caches on different devices (swap out / in).

        ``src``/``dst``: one cache each (block index on dim 0, e.g. ``[num_blocks, block_size, heads,
        head_dim]``) or equal-length sequences of them (per layer, K and V). Synchronous.
        """

    def plan_decode(
        self,
        block_tables: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        sliding_window: int | None = None,
    ) -> object | None:
        """Host-side work that depends only on the step's decode metadata (and the attention's
        ``sliding_window``), done once for all layers that share them (e.g. the CPU backend's length
        buckets); None when the backend needs none."""

    def plan_prefill(
        self,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        seq_lens: torch.Tensor,
        block_size: int,
        group: int,
        sliding_window: int | None = None,
    ) -> object | None:
        """The same for the step's prefill metadata (``group``: query heads per KV head)."""


def get(name: str) -> KernelBackend:
    """The backend registered as ``name`` ("reference", "cpu" or "triton")."""
    return cast(KernelBackend, load_registered(MODULES, name, "kernel backend"))


def plan_nothing(*args: object, **kwargs: object) -> None:
    """``plan_decode`` / ``plan_prefill`` of a backend that needs no per-step plan."""
    return None


def as_list(caches: torch.Tensor | Sequence[torch.Tensor]) -> list[torch.Tensor]:
    """``swap_blocks``' ``src``/``dst``: one cache or a sequence of them, as a list."""
    return [caches] if isinstance(caches, torch.Tensor) else list(caches)
