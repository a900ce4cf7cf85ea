"""transformers' own generation on static batches: the baseline row of the serving benchmarks.

One function, so that every benchmark that compares against transformers runs it the same way:
prompts left-padded with token 0 (masked out), greedy, every sequence run to the same number of
new tokens with EOS ignored (the batch ends together, as static batching does).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any


def generate_static_batch(model: Any, prompts: Sequence[Sequence[int]], new_tokens: int) -> Any:
    """``model.generate`` on one left-padded batch; the output ids, one row per prompt
    (the prompt's padded width, then ``new_tokens``)."""
    import torch

    width = max(len(p) for p in prompts)
    ids = torch.zeros(len(prompts), width, dtype=torch.int64)
    mask = torch.zeros(len(prompts), width, dtype=torch.int64)
    for j, p in enumerate(prompts):
        ids[j, width - len(p) :] = torch.tensor(list(p), dtype=torch.int64)
        mask[j, width - len(p) :] = 1
    with torch.inference_mode():
        return model.generate(
            input_ids=ids,
            attention_mask=mask,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            pad_token_id=0,
            eos_token_id=None,
        )
