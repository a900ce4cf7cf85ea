"""One model step's attention: metadata validated once, the backend chosen once, plans built once.

Why: a forward pass calls the KV write and attention once per layer with the same block tables,
lengths and slot mapping. Checking those (some checks read index tensors back to the host) and
resolving the backend in every layer's call repeated the same work ``num_layers`` times, and the CPU
backend's plans (length buckets, masks) only depend on them. ``prepare_step`` does all of that once;
``PagedStep.write_kv_cache`` / ``PagedStep.attention`` then call the chosen backend directly. The
per-layer tensors (``q``, ``k``, ``v``) are the model's own, shaped by it, so they are not checked.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from pagedkv.kernels import backend, checks
from pagedkv.kernels.backend import KernelBackend
from pagedkv.kernels.dispatch import resolve


@dataclass(slots=True)
class _Prefill:
    block_tables: torch.Tensor  # int [num_prefill_seqs, max_blocks]
    query_start_loc: torch.Tensor  # int [num_prefill_seqs + 1]
    seq_lens: torch.Tensor  # int [num_prefill_seqs]
    max_query_len: int | None
    plan: object | None
    # Plans for sliding-window layers, by window, built by the first layer that uses each.
    window_plans: dict[int, object | None] = field(default_factory=dict)


@dataclass(slots=True)
class _Decode:
    block_tables: torch.Tensor  # int [num_decode_seqs, max_blocks]
    seq_lens: torch.Tensor  # int [num_decode_seqs]
    plan: object | None
    window_plans: dict[int, object | None] = field(default_factory=dict)


@dataclass(slots=True)
class PagedStep:
    """A validated step: tokens ``[0, num_prefill_tokens)`` are prefill queries, the rest decode."""

    backend_name: str
    ops: KernelBackend
    slot_mapping: torch.Tensor
    num_prefill_tokens: int
    scale: float
    prefill: _Prefill | None
    decode: _Decode | None
    # The window the block tables were validated for (``prepare_step``): blocks before it may have
    # been released, so every layer's attention must stay within it. None: full tables.
    sliding_window: int | None = None

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> None:
        self.ops.write_kv_cache(key, value, key_cache, value_cache, self.slot_mapping)

    def attention(
        self,
        query: torch.Tensor,
        key_cache: torch.Tensor,
        value_cache: torch.Tensor,
        *,
        sliding_window: int | None = None,
    ) -> torch.Tensor:
        """``[num_tokens, num_heads, head_dim]``: prefill and decode rows written into one output.

        ``sliding_window`` (W; None: full causal attention): each query at position p sees keys
        ``max(0, p - W + 1) .. p`` only, and blocks wholly before that are not read (as
        ``paged_decode_attention`` / ``paged_prefill_attention`` with the same keyword). A layer
        passes its own (Gemma 3: 512 on its sliding layers, None on its global ones); the backend's
        plans for each window are built by the first layer using it and reused by the rest."""
        if sliding_window is not None or self.sliding_window is not None:
            sliding_window = self._window(sliding_window)
        out = torch.empty_like(query)
        n = self.num_prefill_tokens
        if self.prefill is not None:
            p = self.prefill
            plan = p.plan
            if sliding_window is not None:
                if sliding_window not in p.window_plans:
                    p.window_plans[sliding_window] = self.ops.plan_prefill(
                        p.block_tables,
                        p.query_start_loc,
                        p.seq_lens,
                        key_cache.shape[1],
                        query.shape[1] // key_cache.shape[2],
                        sliding_window=sliding_window,
                    )
                plan = p.window_plans[sliding_window]
            self.ops.paged_prefill_attention(
                query[:n],
                key_cache,
                value_cache,
                p.block_tables,
                p.query_start_loc,
                p.seq_lens,
                self.scale,
                max_query_len=p.max_query_len,
                out=out[:n],
                plan=plan,
                sliding_window=sliding_window,
            )
        if self.decode is not None:
            d = self.decode
            plan = self._decode_plan(d, key_cache.shape[1], sliding_window)
            self.ops.paged_decode_attention(
                query[n:],
                key_cache,
                value_cache,
                d.block_tables,
                d.seq_lens,
                self.scale,
                out=out[n:],
                plan=plan,
                sliding_window=sliding_window,
            )
        return out

    def decode_plan(self, block_size: int, sliding_window: int | None = None) -> object | None:
        """The plan ``attention`` runs the decode rows with for a layer attending within
        ``sliding_window`` (built by the first caller, as there; checked as there): for a caller
        that runs the same kernel on the same tables, e.g. the native decode chain
        (kernels/cpu/decode_layers.py). None without decode rows."""
        if self.decode is None:
            return None
        if sliding_window is not None or self.sliding_window is not None:
            sliding_window = self._window(sliding_window)
        return self._decode_plan(self.decode, block_size, sliding_window)

    def _decode_plan(self, d: _Decode, block_size: int, sliding_window: int | None) -> object | None:
        if sliding_window is None:
            return d.plan
        if sliding_window not in d.window_plans:
            d.window_plans[sliding_window] = self.ops.plan_decode(
                d.block_tables, d.seq_lens, block_size, sliding_window=sliding_window
            )
        return d.window_plans[sliding_window]

    def _window(self, sliding_window: int | None) -> int | None:
        """A layer's window, checked, and within the one the step's tables were validated for."""
        window = checks.sliding_window(sliding_window)
        bound = self.sliding_window
        if bound is not None and (window is None or window > bound):
            raise ValueError(
                f"sliding_window {window} reaches past the step's sliding_window {bound} (prepare_step): "
                "blocks before that window may have been released"
            )
        return window


def prepare_step(
    kv_cache: torch.Tensor,
    num_heads: int,
    scale: float,
    slot_mapping: torch.Tensor,
    num_prefill_tokens: int,
    *,
    prefill: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None,
    max_query_len: int | None = None,
    decode: tuple[torch.Tensor, torch.Tensor] | None = None,
    sliding_window: int | None = None,
) -> PagedStep:
    """Validate a step over the all-layers cache ``kv_cache`` ``[num_layers, 2, num_blocks,
    block_size, num_kv_heads, head_dim]`` and pick its backend.

    ``prefill``: (block_tables, query_start_loc, seq_lens) of the prefill sequences, whose queries
    are the first ``num_prefill_tokens`` tokens; ``decode``: (block_tables, seq_lens) of the decode
    sequences, one token each, after them. ``slot_mapping`` has one slot per token. The backend is
    chosen as for any call (``kernels/dispatch.py``: a worker's ``--kernel-backend`` arrives as a
    ``use_backend`` override around its step). ``sliding_window``: set it only when the block
    tables may lack blocks before that window (released by the block manager): they are then checked
    from the window's first block only, and every layer must attend within a window no larger (a
    full-attention layer raises). Raises ``ValueError`` naming the argument.
    """
    window = checks.sliding_window(sliding_window)
    cache = checks.tensor("kv_cache", kv_cache, 6)
    key_cache, value_cache = cache[0, 0], cache[0, 1]
    num_blocks, block_size, num_kv_heads, _ = checks.kv_cache_pair(key_cache, value_cache)
    checks.heads(num_heads, num_kv_heads)
    tensors: list[tuple[str, torch.Tensor]] = [("kv_cache", cache)]
    sm = checks.tensor("slot_mapping", slot_mapping, 1)
    checks.int_dtype("slot_mapping", sm)
    num_tokens = sm.shape[0]
    checks.slot_mapping(sm, num_tokens, key_cache)
    tensors.append(("slot_mapping", sm))
    if not 0 <= num_prefill_tokens <= num_tokens:
        raise ValueError(
            f"num_prefill_tokens {num_prefill_tokens} is not within the step's {num_tokens} tokens"
        )
    pre = dec = None
    if prefill is not None:
        bt, sl = checks.block_tables_and_lens(
            prefill[0], prefill[2], num_blocks, block_size, window, prefill[1]
        )
        qsl = checks.query_start_loc(prefill[1], sl, num_prefill_tokens)
        tensors += [("prefill block_tables", bt), ("prefill query_start_loc", qsl), ("prefill seq_lens", sl)]
        pre = _Prefill(bt, qsl, sl, max_query_len, None)
    elif num_prefill_tokens:
        raise ValueError(f"{num_prefill_tokens} prefill tokens but no prefill metadata")
    if decode is not None:
        bt, sl = checks.block_tables_and_lens(decode[0], decode[1], num_blocks, block_size, window)
        if bt.shape[0] != num_tokens - num_prefill_tokens:
            raise ValueError(
                f"{bt.shape[0]} decode sequences for {num_tokens - num_prefill_tokens} decode tokens"
            )
        tensors += [("decode block_tables", bt), ("decode seq_lens", sl)]
        dec = _Decode(bt, sl, None)
    elif num_tokens > num_prefill_tokens:
        raise ValueError(f"{num_tokens - num_prefill_tokens} decode tokens but no decode metadata")
    dev = checks.same_device([n for n, _ in tensors], [t for _, t in tensors])
    name = resolve(dev, cache.dtype)
    ops = backend.get(name)
    if window is None:  # else every layer has a window: plans are built per window, when first used
        if pre is not None:
            pre.plan = ops.plan_prefill(
                pre.block_tables, pre.query_start_loc, pre.seq_lens, block_size, num_heads // num_kv_heads
            )
        if dec is not None:
            dec.plan = ops.plan_decode(dec.block_tables, dec.seq_lens, block_size)
    return PagedStep(name, ops, sm, num_prefill_tokens, scale, pre, dec, window)
