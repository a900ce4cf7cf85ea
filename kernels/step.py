"""One model step's attention: metadata validated once, the backend chosen once, plans built once.

Why: a forward pass calls the KV write and attention once per layer with the same block tables,
lengths and slot mapping. Checking those (some checks read index tensors back to the host) and
resolving the backend in every layer's call repeated the same work ``num_layers`` times, and the CPU
backend's plans (length buckets, masks) only depend on them. ``prepare_step`` does all of that once;
``PagedStep.write_kv_cache`` / ``PagedStep.attention`` then call the chosen backend directly. The
per-layer tensors (``q``, ``k``, ``v``) are the model's own, shaped by it, so they are not checked.
"""

from __future__ import annotations

from dataclasses import dataclass

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


@dataclass(slots=True)
class _Decode:
    block_tables: torch.Tensor  # int [num_decode_seqs, max_blocks]
    seq_lens: torch.Tensor  # int [num_decode_seqs]
    plan: object | None


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

    def write_kv_cache(
        self, key: torch.Tensor, value: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> None:
        self.ops.write_kv_cache(key, value, key_cache, value_cache, self.slot_mapping)

    def attention(
        self, query: torch.Tensor, key_cache: torch.Tensor, value_cache: torch.Tensor
    ) -> torch.Tensor:
        """``[num_tokens, num_heads, head_dim]``: prefill and decode rows written into one output."""
        out = torch.empty_like(query)
        n = self.num_prefill_tokens
        if self.prefill is not None:
            p = self.prefill
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
                plan=p.plan,
            )
        if self.decode is not None:
            d = self.decode
            self.ops.paged_decode_attention(
                query[n:],
                key_cache,
                value_cache,
                d.block_tables,
                d.seq_lens,
                self.scale,
                out=out[n:],
                plan=d.plan,
            )
        return out


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
) -> PagedStep:
    """Validate a step over the all-layers cache ``kv_cache`` ``[num_layers, 2, num_blocks,
    block_size, num_kv_heads, head_dim]`` and pick its backend.

    ``prefill``: (block_tables, query_start_loc, seq_lens) of the prefill sequences, whose queries
    are the first ``num_prefill_tokens`` tokens; ``decode``: (block_tables, seq_lens) of the decode
    sequences, one token each, after them. ``slot_mapping`` has one slot per token. The backend is
    chosen as for any call (``kernels/dispatch.py``: a worker's ``--kernel-backend`` arrives as a
    ``use_backend`` override around its step). Raises ``ValueError`` naming the argument.
    """
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
        bt, sl = checks.block_tables_and_lens(prefill[0], prefill[2], num_blocks, block_size)
        qsl = checks.query_start_loc(prefill[1], sl, num_prefill_tokens)
        tensors += [("prefill block_tables", bt), ("prefill query_start_loc", qsl), ("prefill seq_lens", sl)]
        pre = _Prefill(bt, qsl, sl, max_query_len, None)
    elif num_prefill_tokens:
        raise ValueError(f"{num_prefill_tokens} prefill tokens but no prefill metadata")
    if decode is not None:
        bt, sl = checks.block_tables_and_lens(decode[0], decode[1], num_blocks, block_size)
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
    if pre is not None:
        pre.plan = ops.plan_prefill(
            pre.block_tables, pre.query_start_loc, pre.seq_lens, block_size, num_heads // num_kv_heads
        )
    if dec is not None:
        dec.plan = ops.plan_decode(dec.block_tables, dec.seq_lens, block_size)
    return PagedStep(name, ops, sm, num_prefill_tokens, scale, pre, dec)
