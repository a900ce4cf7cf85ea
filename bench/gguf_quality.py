"""A GGUF held in its own quantization against the same file dequantized to fp32: perplexity on a
fixed text and greedy agreement.

Both models are the product's (``load_model(..., held="file")`` and ``held="dense"``, the forms
``--weight-format auto`` and ``fp32`` resolve to on CPU), on the product's CPU kernels.

- Perplexity: the project's own docs (docs/*.md in name order, joined), tokenized with the file's
  tokenizer, the first ``--tokens`` tokens in windows of ``--window`` tokens (each window a fresh
  sequence; every token after a window's first is scored).
- Greedy agreement: ``--prompts`` prompts (consecutive ``--prompt-tokens``-token pieces of the same
  text), ``--new-tokens`` greedy tokens each from both models, run as one batch per model through
  the model runner. Two figures: positions where the two free-running generations hold the same
  token, and (teacher-forced) positions where the quantized model's greedy token equals the fp32
  model's next token given the fp32 model's own prefix.

    python -m bench.gguf_quality --model FILE.gguf
"""

from __future__ import annotations

import argparse
import math
import pathlib
import time
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from pagedkv.arith import ceil_div
from pagedkv.worker_svc.model.batch import AttentionBatch
from pagedkv.worker_svc.model.config import ModelConfig, load_model_config
from pagedkv.worker_svc.model.gguf_file import load_tokenizer
from pagedkv.worker_svc.model.registry import Model
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest

ROOT = pathlib.Path(__file__).resolve().parents[1]
BLOCK = 16
CPU = torch.device("cpu")


@dataclass(slots=True)
class Run:
    model: Model
    load_s: float
    ppl: float
    greedy: list[list[int]]


def docs_text() -> str:
    return "\n\n".join(p.read_text() for p in sorted((ROOT / "docs").glob("*.md")))


def _cache(cfg: ModelConfig, blocks: int) -> torch.Tensor:
    return torch.zeros((cfg.num_layers, 2, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim))


def window_logits(model: Model, cfg: ModelConfig, tokens: list[int], cache: torch.Tensor) -> torch.Tensor:
    """fp32 logits at every position of one sequence, prefilled in one forward pass."""
    n = len(tokens)
    blocks = ceil_div(n, BLOCK)
    batch = AttentionBatch(
        positions=torch.arange(n, dtype=torch.int64),
        slot_mapping=torch.arange(n, dtype=torch.int64),
        logits_indices=torch.arange(n, dtype=torch.int64),
        num_prefill_tokens=n,
        prefill_block_tables=torch.arange(blocks, dtype=torch.int32)[None],
        prefill_query_start_loc=torch.tensor([0, n], dtype=torch.int32),
        prefill_seq_lens=torch.tensor([n], dtype=torch.int32),
        decode_block_tables=None,
        decode_seq_lens=None,
        prefill_max_query_len=n,
    )
    return model.forward(torch.tensor(tokens, dtype=torch.int64), batch, cache)


def perplexity(model: Model, cfg: ModelConfig, tokens: list[int], window: int) -> float:
    cache = _cache(cfg, ceil_div(window, BLOCK))
    nll, count = 0.0, 0
    for start in range(0, len(tokens) - 1, window):
        chunk = tokens[start : start + window]
        if len(chunk) < 2:
            break
        logp = torch.log_softmax(window_logits(model, cfg, chunk, cache).double(), dim=-1)
        target = torch.tensor(chunk[1:])
        nll -= float(logp[:-1].gather(1, target[:, None]).sum())
        count += len(chunk) - 1
    return math.exp(nll / count)


def greedy(model: Model, cfg: ModelConfig, prompts: list[list[int]], new_tokens: int) -> list[list[int]]:
    """``new_tokens`` greedy tokens per prompt, all prompts as one batch, through the model runner."""
    per_seq = ceil_div(max(map(len, prompts)) + new_tokens, BLOCK)
    cache = _cache(cfg, per_seq * len(prompts))
    runner = ModelRunner(model, cache, _cache(cfg, 1))
    tables = [list(range(i * per_seq, (i + 1) * per_seq)) for i in range(len(prompts))]
    out: list[list[int]] = [[] for _ in prompts]
    step = [SequenceRequest(f"s{i}", list(p), tables[i], 0) for i, p in enumerate(prompts)]
    for _ in range(new_tokens):
        result = runner.step(step)
        for i, o in enumerate(result.outputs):
            out[i].append(o.token_id)
        step = [SequenceRequest(s.seq_id, [out[i][-1]], tables[i], s.seq_len) for i, s in enumerate(step)]
    return out


def teacher_forced_agreement(
    model: Model, cfg: ModelConfig, prompts: list[list[int]], reference: list[list[int]]
) -> float:
    """Fraction of the reference's generated positions where ``model``'s greedy token, given the
    reference's prefix, equals the reference's token."""
    same = total = 0
    longest = max(len(p) + len(r) for p, r in zip(prompts, reference, strict=True))
    cache = _cache(cfg, ceil_div(longest, BLOCK))
    for p, r in zip(prompts, reference, strict=True):
        logits = window_logits(model, cfg, p + r, cache)
        picks = logits[len(p) - 1 : len(p) - 1 + len(r)].argmax(dim=-1).tolist()
        same += sum(a == b for a, b in zip(picks, r, strict=True))
        total += len(r)
    return same / total


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="a GGUF file")
    p.add_argument("--tokens", type=int, default=4096, help="tokens of the docs scored for perplexity")
    p.add_argument("--window", type=int, default=512)
    p.add_argument("--prompts", type=int, default=32)
    p.add_argument("--prompt-tokens", type=int, default=24)
    p.add_argument("--new-tokens", type=int, default=32)
    args = p.parse_args(argv)
    torch.set_grad_enabled(False)
    cfg = load_model_config(args.model)
    tok = load_tokenizer(args.model)
    ids: list[int] = tok(docs_text(), add_special_tokens=False)["input_ids"]
    scored = ids[: args.tokens]
    rest = ids[args.tokens :]
    prompts = [rest[i * args.prompt_tokens : (i + 1) * args.prompt_tokens] for i in range(args.prompts)]
    runs: dict[str, Run] = {}
    for form in ("dense", "file"):
        t0 = time.perf_counter()
        m = load_model(args.model, cfg, torch.float32, CPU, held=form)
        load_s = time.perf_counter() - t0
        ppl = perplexity(m, cfg, scored, args.window)
        runs[form] = Run(m, load_s, ppl, greedy(m, cfg, prompts, args.new_tokens))
    ref, q = runs["dense"], runs["file"]
    pairs = [(a, b) for ra, qa in zip(ref.greedy, q.greedy, strict=True) for a, b in zip(ra, qa, strict=True)]
    free = sum(a == b for a, b in pairs) / len(pairs)
    forced = teacher_forced_agreement(q.model, cfg, prompts, ref.greedy)
    print(f"model {pathlib.Path(args.model).name}; text: docs/*.md, {len(scored)} tokens")
    print(f"in windows of {args.window}")
    print("| weights | linear path | resident weight MB | perplexity | load s |")
    print("|---|---|---:|---:|---:|")
    for form, label in (("dense", "fp32 (dequantized)"), ("file", "the file's own quantization")):
        r = runs[form]
        mb = r.model.weight_bytes / 1e6
        print(f"| {label} | {r.model.linear_path} | {mb:.1f} | {r.ppl:.4f} | {r.load_s:.1f} |")
    ratio = q.ppl / ref.ppl
    print(f"perplexity, quantized / fp32: {ratio:.4f} ({(ratio - 1) * 100:+.2f}%)")
    print(
        f"greedy agreement over {args.prompts} prompts x {args.new_tokens} tokens: "
        f"free-running {free * 100:.1f}% of positions, teacher-forced {forced * 100:.1f}%"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
