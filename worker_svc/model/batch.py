"""What one forward pass computes: the flat token layout and the attention metadata of its sequences.

Architecture-neutral: the model runner builds it (``model_runner.build_batch``), every architecture
module reads it, and ``kernels_step`` hands it to the kernels, which validate it once per step
(``kernels/step.py``) instead of once per layer.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from pagedkv import kernels


@dataclass(slots=True)
class AttentionBatch:
    """Where the tokens of one forward pass go in the cache and what they attend to.

    Tokens ``[0, num_prefill_tokens)`` belong to prefill sequences (query_start_loc delimits them),
    the rest to decode sequences (one each). All index tensors live on the model's device.
    """

    positions: torch.Tensor  # int64 [num_tokens]: absolute position of each token
    slot_mapping: torch.Tensor  # int64 [num_tokens]: block_id * block_size + offset
    # int64 [num_seqs]: flat index of each sequence's last token, in the requests' order
    logits_indices: torch.Tensor
    num_prefill_tokens: int
    prefill_block_tables: torch.Tensor | None  # int32 [num_prefill_seqs, max_blocks]
    prefill_query_start_loc: torch.Tensor | None  # int32 [num_prefill_seqs + 1]
    prefill_seq_lens: torch.Tensor | None  # int32 [num_prefill_seqs]
    decode_block_tables: torch.Tensor | None  # int32 [num_decode_seqs, max_blocks]
    decode_seq_lens: torch.Tensor | None  # int32 [num_decode_seqs]
    # Longest prefill query run, known on the host: passed to every layer's prefill kernel so it
    # never reads query_start_loc back from the device (one sync per layer otherwise).
    prefill_max_query_len: int = 0
    # KV-cache groups (worker_svc/model/kv_layout.py): this batch's tables and slots are group 0's;
    # ``groups`` holds groups 1..'s (same tokens and positions, their own tables and slots). A
    # window group's tables have -1 before its window (released blocks): its ``sliding_window``.
    groups: tuple[AttentionBatch, ...] = ()
    sliding_window: int | None = None
    # Known on the host: ``logits_indices`` is 0..n-1 over a decode step's n rows (each sequence's
    # one token, in order). False when a speculative verification's positions are decode rows of
    # their own and the indices reorder them (CUDA graphs, which replay with 0..n-1, reorder after).
    logits_in_order: bool = True

    def kernels_step(self, kv_cache: torch.Tensor, num_heads: int, scale: float) -> kernels.PagedStep:
        """The step's attention, validated and planned once for all layers."""
        prefill = decode = None
        if self.prefill_block_tables is not None:
            assert self.prefill_query_start_loc is not None and self.prefill_seq_lens is not None
            prefill = (self.prefill_block_tables, self.prefill_query_start_loc, self.prefill_seq_lens)
        if self.decode_block_tables is not None:
            assert self.decode_seq_lens is not None
            decode = (self.decode_block_tables, self.decode_seq_lens)
        return kernels.prepare_step(
            kv_cache,
            num_heads,
            scale,
            self.slot_mapping,
            self.num_prefill_tokens,
            prefill=prefill,
            max_query_len=self.prefill_max_query_len or None,
            decode=decode,
            sliding_window=self.sliding_window,
        )
