"""Choosing the next token: greedy, or temperature / top-k / top-p sampling with seeded draws.

Determinism across processes: each sampled sequence gets one uniform number per step from a CPU
``torch.Generator`` seeded by ``(seed, position)``; the token is found by inverse-CDF sampling over
the filtered, sorted distribution. So the same seed at the same position gives the same token on
any worker, whichever other sequences share the batch, and only one random number per sequence
crosses to the device. Everything else is batched tensor math.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

from kernels import cpu_native
from pagedkv import defaults

_MASK64 = (1 << 64) - 1


MAX_TOP_LOGPROBS = defaults.MAX_TOP_LOGPROBS  # one value for the frontend and the workers


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    num_top_logprobs: int = 0  # also report this many most likely tokens with their logprobs

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1


@dataclass(slots=True)
class SampleResult:
    token_ids: torch.Tensor  # int64 [num_seqs] (CPU)
    logprobs: torch.Tensor  # fp32 [num_seqs] (CPU): log p(token) under the unmodified model
    # Per row: the num_top_logprobs most likely (token, logprob), most likely first ([] when 0).
    top: list[list[tuple[int, float]]]


def draw_uniform(seed: int | None, position: int) -> float:
    """One uniform in [0, 1) for (seed, position); fresh randomness when no seed was given."""
    if seed is None:
        mixed = int.from_bytes(os.urandom(8), "little")
    else:
        # splitmix64-style mixing so that neighbouring seeds/positions give unrelated streams.
        z = (seed * 0x9E3779B97F4A7C15 + position * 0xBF58476D1CE4E5B9 + 0x94D049BB133111EB) & _MASK64
        z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
        z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
        mixed = z ^ (z >> 31)
    gen = torch.Generator().manual_seed(mixed & ((1 << 63) - 1))
    return float(torch.rand((), generator=gen, dtype=torch.float64))


ARGMAX_CHUNK = 128  # columns per chunk of argmax_rows' first pass


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """``torch.argmax(logits, dim=-1)`` (int64 ``[rows]``, the first index of each row's maximum),
    computed from chunk maxima on CPU.

    Why: on CPU ``argmax`` over a vocabulary row is a scalar loop while ``amax`` is vectorized;
    at 48 rows x 32,000 (a decode step's logits) argmax took 1.7 ms and amax 0.17 ms (2 threads).
    So: each row's maximum per chunk of ``ARGMAX_CHUNK`` columns (``amax``), the first chunk
    holding the row's maximum (argmax over the few chunk maxima), then the first maximum inside
    that chunk. Same index as ``argmax`` for every input, ties and NaN included (a NaN is the
    maximum for both; tests/worker_svc/test_sampling.py)."""
    rows, vocab = logits.shape
    if logits.device.type != "cpu" or vocab < 4 * ARGMAX_CHUNK or rows == 0:
        return torch.argmax(logits, dim=-1)
    full = vocab // ARGMAX_CHUNK * ARGMAX_CHUNK
    chunk_max = logits[:, :full].reshape(rows, full // ARGMAX_CHUNK, ARGMAX_CHUNK).amax(-1)
    if full < vocab:  # the ragged tail is one more "chunk"
        chunk_max = torch.cat((chunk_max, logits[:, full:].amax(-1, keepdim=True)), dim=1)
    chunk = torch.argmax(chunk_max, dim=-1)  # first chunk holding the row maximum
    start = chunk * ARGMAX_CHUNK
    cols = (start[:, None] + torch.arange(ARGMAX_CHUNK)[None, :]).clamp_(max=vocab - 1)
    return start + torch.argmax(logits.gather(1, cols), dim=-1)


def sample(logits: torch.Tensor, params: list[SamplingParams], positions: list[int]) -> SampleResult:
    """Pick one token per row of fp32 ``logits [num_seqs, vocab]``.

    ``positions[i]`` is the position the chosen token will take in sequence i (its length so far):
    the "step" that, with the seed, fixes the random draw.
    """
    # log p(token) = logit - logsumexp(row): no [num_seqs, vocab] log-softmax tensor is written.
    # On CPU the native kernel gives the log-sum-exp and the greedy token from the same two passes
    # over each row (kernels/csrc/logsumexp.c: 0.31 ms at 48 x 32,000 against 0.31 + 0.17 ms
    # for the log-sum-exp and argmax_rows apart; torch's logsumexp alone takes 0.89 ms).
    fused = cpu_native.logsumexp_argmax_rows(logits)
    if fused is not None:
        log_norm, tokens = fused
    else:
        log_norm, tokens = cpu_native.logsumexp_rows(logits), argmax_rows(logits)
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        sub = logits.index_select(0, rows)
        temps = torch.tensor([params[i].temperature for i in sampled_rows], device=logits.device)
        top_ks = torch.tensor(
            [params[i].top_k if params[i].top_k > 0 else logits.shape[-1] for i in sampled_rows],
            device=logits.device,
        )
        top_ps = torch.tensor(
            [params[i].top_p if 0.0 < params[i].top_p < 1.0 else 1.0 for i in sampled_rows],
            device=logits.device,
            dtype=torch.float32,
        )
        uniforms = torch.tensor(
            [draw_uniform(params[i].seed, positions[i]) for i in sampled_rows],
            device=logits.device,
            dtype=torch.float32,
        )
        tokens[rows] = _sample_filtered(sub / temps[:, None], top_ks, top_ps, uniforms)
    chosen_logprobs = logits.gather(1, tokens[:, None]).squeeze(1) - log_norm
    return SampleResult(
        token_ids=tokens.cpu(), logprobs=chosen_logprobs.cpu(), top=_top_logprobs(logits, log_norm, params)
    )


def _top_logprobs(
    logits: torch.Tensor, log_norm: torch.Tensor, params: list[SamplingParams]
) -> list[list[tuple[int, float]]]:
    """One topk over the rows that asked (the largest count asked), cut per row."""
    top: list[list[tuple[int, float]]] = [[] for _ in params]
    rows = [i for i, p in enumerate(params) if p.num_top_logprobs > 0]
    if not rows:
        return top
    k = min(max(params[i].num_top_logprobs for i in rows), logits.shape[-1])
    index = torch.tensor(rows, device=logits.device)
    top_values, top_ids = torch.topk(logits.index_select(0, index), k, dim=-1)
    values = (top_values - log_norm.index_select(0, index)[:, None]).cpu().tolist()
    ids = top_ids.cpu().tolist()
    for j, i in enumerate(rows):
        n = params[i].num_top_logprobs
        top[i] = list(zip(ids[j][:n], values[j][:n], strict=True))
    return top


def _sample_filtered(
    scaled: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor, uniforms: torch.Tensor
) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    sorted_logits = sorted_logits.masked_fill(ranks >= top_ks[:, None], float("-inf"))
    probs = torch.softmax(sorted_logits, dim=-1)
    # top-p: drop a token when the mass before it already reaches p (the first token always stays).
    mass_before = torch.cumsum(probs, dim=-1) - probs
    probs = probs.masked_fill(mass_before >= top_ps[:, None], 0.0)
    cdf = torch.cumsum(probs, dim=-1)
    target = uniforms[:, None] * cdf[:, -1:]
    choice = torch.searchsorted(cdf, target, right=True).clamp_(max=scaled.shape[-1] - 1)
    # Never land on a zero-probability tail entry through rounding.
    kept = (probs > 0).sum(dim=-1, keepdim=True) - 1
    choice = torch.minimum(choice, kept)
    return sorted_idx.gather(1, choice).squeeze(1)
