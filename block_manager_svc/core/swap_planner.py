"""Swap or recompute: the cost model behind preemption, as pure functions.

Preempting a sequence (or a fork group) frees its GPU blocks one of two ways:

* swap: copy its blocks to the CPU pool now and back later. Cost
  2 x bytes moved / host-link bandwidth (out and in again), where bytes moved =
  distinct GPU blocks x `kv_bytes_per_block`.
* recompute: drop its blocks; the frontend re-prefills it later. Cost
  tokens to recompute / `prefill_tokens_per_s`. Tokens held in full, hashed
  blocks that stay referenced by other sequences are not counted: the
  re-prefill will find them in the prefix cache.

`auto` takes the cheaper one, and swap only when the CPU pool has room for
every distinct block; `swap` swaps whenever it fits and recomputes otherwise
(a victim must go somewhere); `recompute` always recomputes. The defaults
(the `DEFAULT_*` constants below) model a Llama-3-8B-like KV block (2 x 32
layers x 8 KV heads x 128 dims x 2 bytes x 16 tokens = 2 MiB), the effective
rate of a PCIe 5 x16 host link, and a GPU prefill rate of that model; a
deployment sets its own (docs/policies.md).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass

MODES = ("auto", "swap", "recompute", "off")
DEFAULT_KV_BYTES_PER_BLOCK = 2 * 32 * 8 * 128 * 2 * 16  # 2 MiB
DEFAULT_HOST_LINK_BYTES_PER_S = 25e9
DEFAULT_PREFILL_TOKENS_PER_S = 10_000.0


class PreemptionMode(enum.Enum):
    SWAP = "swap"
    RECOMPUTE = "recompute"


@dataclass(slots=True, frozen=True)
class CostModel:
    kv_bytes_per_block: int = DEFAULT_KV_BYTES_PER_BLOCK
    host_link_bytes_per_s: float = DEFAULT_HOST_LINK_BYTES_PER_S
    prefill_tokens_per_s: float = DEFAULT_PREFILL_TOKENS_PER_S

    def __post_init__(self) -> None:
        if self.kv_bytes_per_block < 1:
            raise ValueError("kv_bytes_per_block must be >= 1")
        if self.host_link_bytes_per_s <= 0 or self.prefill_tokens_per_s <= 0:
            raise ValueError("host_link_bytes_per_s and prefill_tokens_per_s must be > 0")

    def swap_cost_s(self, num_blocks: int) -> float:
        return 2.0 * num_blocks * self.kv_bytes_per_block / self.host_link_bytes_per_s

    def recompute_cost_s(self, num_tokens: int) -> float:
        return num_tokens / self.prefill_tokens_per_s


@dataclass(slots=True, frozen=True)
class SwapDecision:
    mode: PreemptionMode
    cost_s: float


def decide(
    mode: str, model: CostModel, num_blocks: int, recompute_tokens: int, cpu_free: int
) -> SwapDecision:
    """How to preempt a victim holding `num_blocks` distinct GPU blocks whose
    re-prefill would cost `recompute_tokens` tokens, with `cpu_free` CPU blocks free."""
    recompute = SwapDecision(PreemptionMode.RECOMPUTE, model.recompute_cost_s(recompute_tokens))
    if mode == "recompute" or num_blocks > cpu_free:
        return recompute
    swap = SwapDecision(PreemptionMode.SWAP, model.swap_cost_s(num_blocks))
    if mode == "swap":
        return swap
    if mode != "auto":
        raise ValueError(f"unknown preemption mode {mode!r} (known: {', '.join(MODES)})")
    return swap if swap.cost_s < recompute.cost_s else recompute
