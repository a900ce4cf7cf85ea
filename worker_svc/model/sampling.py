"""Choosing the next token: greedy, or temperature / min-p / top-k / top-p sampling with seeded
draws, after the logit adjustments a request may ask for (logit bias, repetition / frequency /
presence penalties).

Determinism across processes: each sampled sequence gets one uniform number per step from a CPU
``torch.Generator`` seeded by ``(seed, position)``; the token is found by inverse-CDF sampling over
the filtered, sorted distribution. So the same seed at the same position gives the same token on
any worker, whichever other sequences share the batch, and only one random number per sequence
crosses to the device. Everything else is batched tensor math.

The order is vLLM's: logit bias, then the penalties (repetition, then frequency and presence), on
the model's logits; greedy picks the argmax of the result; sampling divides by the temperature,
drops tokens under min-p, then top-k, then top-p of what is left. Logprobs stay the model's
(before any of this), as vLLM reports them by default.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass, field

import torch

from pagedkv import defaults
from pagedkv.kernels.cpu import native as cpu_native

_MASK64 = (1 << 64) - 1


MAX_TOP_LOGPROBS = defaults.MAX_TOP_LOGPROBS  # one value for the frontend and the workers


@dataclass(slots=True, frozen=True)
class SamplingParams:
    temperature: float = 0.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    num_top_logprobs: int = 0  # also report this many most likely tokens with their logprobs
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0  # 1 = off
    min_p: float = 0.0
    logit_bias: tuple[tuple[int, float], ...] = ()  # (token id, added to its logit)

    @property
    def greedy(self) -> bool:
        return self.temperature <= 0.0 or self.top_k == 1

    @property
    def penalized(self) -> bool:
        """Whether the token history (TokenHistory) changes this sequence's logits."""
        return self.presence_penalty != 0.0 or self.frequency_penalty != 0.0 or self.repetition_penalty != 1.0

    @property
    def adjusts(self) -> bool:
        """Whether anything changes the model's logits before the choice."""
        return self.penalized or bool(self.logit_bias)


@dataclass(slots=True, frozen=True)
class TokenHistory:
    """What the penalties look at: the distinct generated tokens with their counts, and the
    distinct prompt tokens (repetition_penalty counts those too, as vLLM and Hugging Face do)."""

    output_ids: Sequence[int] = ()
    output_counts: Sequence[int] = ()
    prompt_ids: Sequence[int] = field(default=())


@dataclass(slots=True)
class SampleResult:
    token_ids: torch.Tensor  # int64 [num_seqs] (CPU)
    logprobs: torch.Tensor  # fp32 [num_seqs] (CPU): log p(token) under the unmodified model
    # Per row: the num_top_logprobs most likely (token, logprob), most likely first ([] when 0).
    top: list[list[tuple[int, float]]]


MAX_PENALTY = 2.0  # presence / frequency penalties: OpenAI's range, -2..2
MAX_LOGIT_BIAS = 100.0  # OpenAI's logit_bias range, -100..100


def sampling_knob_error(p: SamplingParams, vocab_size: int) -> str | None:
    """What is wrong with the penalties, min-p or logit bias of ``p`` (the field, then why), or None."""
    for name in ("presence_penalty", "frequency_penalty"):
        v = getattr(p, name)
        if not (math.isfinite(v) and -MAX_PENALTY <= v <= MAX_PENALTY):
            return f"{name} {v} is outside [-{MAX_PENALTY:g}, {MAX_PENALTY:g}]"
    if not (math.isfinite(p.repetition_penalty) and p.repetition_penalty > 0):
        return f"repetition_penalty {p.repetition_penalty} must be a finite number > 0"
    if not 0.0 <= p.min_p <= 1.0:
        return f"min_p {p.min_p} is outside [0, 1]"
    ids = [t for t, _ in p.logit_bias]
    if len(set(ids)) != len(ids):
        return "logit_bias repeats a token id"
    if ids and max(ids) >= vocab_size:
        return f"logit_bias token id {max(ids)} >= vocab_size {vocab_size}"
    bad = next((b for _, b in p.logit_bias if not -MAX_LOGIT_BIAS <= b <= MAX_LOGIT_BIAS), None)
    if bad is not None:
        return f"logit_bias value {bad} is outside [-{MAX_LOGIT_BIAS:g}, {MAX_LOGIT_BIAS:g}]"
    return None


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

    Why: on CPU ``argmax`` over a vocabulary row is a scalar loop while ``amax`` is vectorized, so
    over a decode step's logits ``amax`` takes a fraction of ``argmax``'s time (docs/kernels.md,
    "Sampling", has the figures). So: each row's maximum per chunk of ``ARGMAX_CHUNK`` columns
    (``amax``), the first chunk holding the row's maximum (argmax over the few chunk maxima), then
    the first maximum inside that chunk. Same index as ``argmax`` for every input, ties and NaN
    included (a NaN is the maximum for both; tests/worker_svc/model/test_sampling.py)."""
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


def sample(
    logits: torch.Tensor,
    params: list[SamplingParams],
    positions: list[int],
    histories: Sequence[TokenHistory | None] | None = None,
    masks: Sequence[bytes | None] | None = None,
) -> SampleResult:
    """Pick one token per row of fp32 ``logits [num_seqs, vocab]``.

    ``positions[i]`` is the position the chosen token will take in sequence i (its length so far):
    the "step" that, with the seed, fixes the random draw. ``histories[i]``: row i's token history,
    needed (else taken as empty) when its parameters set a penalty. ``masks[i]``: row i's
    allowed-token bitmask (grammar-constrained decoding, ``allowed_token_mask`` of the step
    message), or None.
    """
    # log p(token) = logit - logsumexp(row): no [num_seqs, vocab] log-softmax tensor is written.
    # On CPU the native kernel gives the log-sum-exp and the greedy token from the same two passes
    # over each row (kernels/cpu/csrc/logsumexp.c), so the greedy token costs no pass of its own over
    # the vocabulary (docs/kernels.md, "Sampling", has the figures).
    fused = cpu_native.logsumexp_argmax_rows(logits)
    if fused is not None:
        log_norm, tokens = fused
    else:
        log_norm, tokens = cpu_native.logsumexp_rows(logits), argmax_rows(logits)
    # Rows whose logits a bias or penalty changes: adjusted copies of just those rows.
    adjusted_rows = [i for i, p in enumerate(params) if p.adjusts or (masks is not None and masks[i])]
    adjusted: dict[int, torch.Tensor] = {}
    if adjusted_rows:
        index = torch.tensor(adjusted_rows, device=logits.device)
        adj = adjust_logits(
            logits.index_select(0, index),
            [params[i] for i in adjusted_rows],
            [histories[i] if histories is not None else None for i in adjusted_rows],
            [masks[i] if masks is not None else None for i in adjusted_rows],
        )
        adjusted = {row: adj[j] for j, row in enumerate(adjusted_rows)}
        greedy_adjusted = [j for j, row in enumerate(adjusted_rows) if params[row].greedy]
        if greedy_adjusted:
            picked = argmax_rows(adj[greedy_adjusted])
            tokens[[adjusted_rows[j] for j in greedy_adjusted]] = picked
    sampled_rows = [i for i, p in enumerate(params) if not p.greedy]
    if sampled_rows:
        rows = torch.tensor(sampled_rows, device=logits.device)
        sub = logits.index_select(0, rows)
        for j, row in enumerate(sampled_rows):
            if row in adjusted:
                sub[j] = adjusted[row]
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
        min_ps = torch.tensor(
            [params[i].min_p for i in sampled_rows], device=logits.device, dtype=torch.float32
        )
        uniforms = torch.tensor(
            [draw_uniform(params[i].seed, positions[i]) for i in sampled_rows],
            device=logits.device,
            dtype=torch.float32,
        )
        tokens[rows] = _sample_filtered(sub / temps[:, None], top_ks, top_ps, min_ps, uniforms)
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


@dataclass(slots=True)
class Scored:
    """A given token's place in the model's distribution at a position (vLLM's prompt logprobs)."""

    token_id: int
    logprob: float
    rank: int  # tokens of the vocabulary whose logprob is at least this one's (1 = the most likely)
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), most likely first


def score_tokens(logits: torch.Tensor, token_ids: Sequence[int], num_top: int) -> list[Scored]:
    """Row i of fp32 ``logits [rows, vocab]`` scores ``token_ids[i]``: its logprob under the
    model's own log-softmax (the same log-sum-exp as :func:`sample`'s logprobs, before any
    sampling adjustment: vLLM's default raw logprobs), its rank as vLLM counts it (the tokens whose
    logit is at least its own, itself included) and the ``num_top`` most likely tokens."""
    if not token_ids:
        return []
    log_norm = cpu_native.logsumexp_rows(logits)
    target = torch.tensor(list(token_ids), dtype=torch.int64, device=logits.device)[:, None]
    chosen = logits.gather(1, target)
    ranks = (logits >= chosen).sum(-1).tolist()
    logprobs = (chosen.squeeze(1) - log_norm).tolist()
    tops: list[list[tuple[int, float]]] = [[] for _ in token_ids]
    k = min(num_top, logits.shape[-1])
    if k:
        values, ids = torch.topk(logits, k, dim=-1)
        lps = (values - log_norm[:, None]).tolist()
        tops = [list(zip(row, lp, strict=True)) for row, lp in zip(ids.tolist(), lps, strict=True)]
    return [
        Scored(int(t), float(lp), int(r), top)
        for t, lp, r, top in zip(token_ids, logprobs, ranks, tops, strict=True)
    ]


def allowed_tokens(masks: Sequence[bytes], vocab_size: int, device: torch.device) -> torch.Tensor:
    """A bool ``[len(masks), vocab_size]`` from allowed-token bitmasks of equal length (bit t % 32
    of 32-bit little-endian word t // 32), unpacked in one batched operation."""
    packed = torch.frombuffer(bytearray(b"".join(masks)), dtype=torch.uint8).view(len(masks), -1).to(device)
    bits = (packed[:, :, None] >> torch.arange(8, dtype=torch.uint8, device=device)) & 1
    return bits.view(len(masks), -1)[:, :vocab_size].bool()


def adjust_logits(
    logits: torch.Tensor,
    params: Sequence[SamplingParams],
    histories: Sequence[TokenHistory | None],
    masks: Sequence[bytes | None] | None = None,
) -> torch.Tensor:
    """A new tensor: ``logits [rows, vocab]`` with each row's logit bias, then its repetition
    penalty (tokens of the prompt or the output: a positive logit divided by it, a negative one
    multiplied), then its frequency (times the count) and presence penalties subtracted. Tokens its
    grammar mask does not allow are -inf (set first: no adjustment brings them back)."""
    out = logits.clone()
    rows, vocab = out.shape
    dev = out.device
    given = [(r, mask) for r, mask in enumerate(masks or ()) if mask]
    masked = [r for r, _ in given]
    if given:
        allowed = allowed_tokens([mask for _, mask in given], vocab, dev)
        if len(masked) == rows:
            out.masked_fill_(~allowed, float("-inf"))
        else:
            index = torch.tensor(masked, device=dev)
            out[index] = out[index].masked_fill(~allowed, float("-inf"))
    for r, (p, h) in enumerate(zip(params, histories, strict=True)):
        if p.logit_bias:
            ids = torch.tensor([t for t, _ in p.logit_bias], device=dev, dtype=torch.long)
            out[r].index_add_(0, ids, torch.tensor([b for _, b in p.logit_bias], device=dev, dtype=out.dtype))
        if not p.penalized or h is None:
            continue
        out_ids = torch.tensor(list(h.output_ids), device=dev, dtype=torch.long)
        if p.repetition_penalty != 1.0:
            prompt_ids = torch.tensor(list(h.prompt_ids), device=dev, dtype=torch.long)
            seen = torch.cat((out_ids, prompt_ids)).unique()
            vals = out[r, seen]
            out[r, seen] = torch.where(vals > 0, vals / p.repetition_penalty, vals * p.repetition_penalty)
        if len(out_ids) and (p.frequency_penalty != 0.0 or p.presence_penalty != 0.0):
            counts = torch.tensor(list(h.output_counts), device=dev, dtype=out.dtype)
            out[r, out_ids] -= p.frequency_penalty * counts + p.presence_penalty
    return out


def _sample_filtered(
    scaled: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    min_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> torch.Tensor:
    sorted_logits, sorted_idx = torch.sort(scaled, dim=-1, descending=True)
    ranks = torch.arange(scaled.shape[-1], device=scaled.device)[None, :]
    # min-p: p / p_max < min_p  <=>  logit < max logit + log(min_p) (a prefix of the sorted row, as
    # top-k's is; both before top-p, which renormalises what they leave).
    floor = sorted_logits[:, :1] + torch.log(min_ps[:, None])
    drop = (ranks >= top_ks[:, None]) | ((sorted_logits < floor) & (ranks > 0))
    sorted_logits = sorted_logits.masked_fill(drop, float("-inf"))
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


def accept_proposals(proposed: Sequence[int], drawn: Sequence[int]) -> int:
    """Speculative decoding's acceptance: how many of the ``proposed`` tokens (k) the target
    keeps, given ``drawn`` (k + 1): the token the target's own sampling drew at each position
    of the verification pass, row j after the proposals before j. The longest prefix with
    ``proposed[j] == drawn[j]`` is kept; the sequence then goes on with ``drawn[accepted]``.

    Why this is rejection sampling that keeps the target's distribution: the proposers here are
    deterministic (the proposal is a point mass q on one token d), so rejection sampling accepts
    d with probability min(1, p(d) / q(d)) = p(d) and otherwise draws from the residual
    (p - q)+, which is p without d, renormalised. Drawing t ~ p and accepting iff t == d does
    exactly that: it accepts with probability p(d), and a rejection's t is p conditioned on
    t != d. Drawing with the uniform plain decoding would use at the same (seed, position)
    (``draw_uniform``) makes a seeded sequence's tokens those of plain decoding, and greedy
    rows (an argmax) are exactly plain greedy decoding."""
    if len(drawn) != len(proposed) + 1:
        raise ValueError(f"{len(proposed)} proposals need {len(proposed) + 1} drawn tokens, got {len(drawn)}")
    accepted = 0
    for want, got in zip(proposed, drawn, strict=False):
        if want != got:
            break
        accepted += 1
    return accepted
