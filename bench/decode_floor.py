"""Batch-1 decode time per output token against the weight-read floor, per weight form and linear kernel.

The floor: a decode step of one sequence reads every weight once, so it cannot take less than the
resident weight bytes over the memory's read bandwidth. The bandwidth is measured here, on the
same machine in the same run (the best of ``--reps`` sums over a 512 MiB fp32 buffer, torch's
threads). Then, in one process and alternating round by round (this VM's speed drifts):

- **decode**: each model (``--forms``: ``dense`` = the file dequantized to fp32 on the native fp32
  linear kernel; ``file`` = its own quantization on the native int4 / int8 / K-quant kernels, and
  again with PyTorch's weight-packed int4 / int8 operators where it has one: K-quant matrices stay
  on the native kernel there, PyTorch has no K-quant operator; and, where the CPU has AVX-512
  VNNI, with the int4 / int8 kernels' 16-bit integer products turned off, the fp32 products on
  the same rounded x: ``cpu_quant_linear.word_products``) runs one sequence, a short prompt, then
  ``--tokens`` decode steps per round through the product's model runner (median step);
- **plain read**: after each model's steps, its weight tensors (the bytes the floor counts) read
  ``--reps`` times with no arithmetic, tensor after tensor in a decode step's order, each split
  over the same threads, in one native call (``cpu_native.read_spans``; median): what streaming
  exactly the step's weights costs, as the step reads them. Beside it, the same bytes copied once
  into one buffer and read as one span: against the floor, what the host's cache gives a model of
  this size (one smaller than the last-level cache reads faster than the floor); against the
  tensor-by-tensor read, what reading ~120 separate matrices (two arrays each when quantized)
  costs over one stream. "/ plain read" is the step against its weights' tensor-by-tensor read:
  the kernels' arithmetic slowing the stream, and the work between the matrices (attention,
  norms, the runner, sampling);
- **linear layers**: every matrix of a kind once at ``--rows`` rows (median pass), per kernel:
  the fp32 native kernel on the dense model's matrices, the native int4 kernel and PyTorch's int4
  operator on the file's int4 layers, the native int8 kernel and PyTorch's int8 operator on its
  int8 output layer, the native K-quant kernel on its Q4_K / Q6_K matrices (all Q4_K_M's).
  The native int4 and int8 kernels run twice more where the CPU has the 16-bit integer products:
  with every row as it would be alone (``ARITH_ROWS``: a decode step's rows, a speculative
  verification's positions), and, where the CPU also has AMX-INT8, the int4 kernel both ways again
  with the AMX tiles turned off (``cpu_quant_linear.tile_products``): what a verification's extra
  rows, and a prefill's rows (the many-row arithmetic the tiles replace), cost without them.
  GB/s = the matrices' resident bytes / the pass.

    python -m bench.decode_floor --model FILE.gguf [--forms dense file] [--threads 2] [--rows 1 8 64]

The development VM's 2 cores are shared with other jobs: compare the rows of one run, not runs.
"""

from __future__ import annotations

import argparse
import dataclasses
import functools
import statistics
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from pagedkv.arith import ceil_div
from pagedkv.kernels.cpu import native as cpu_native
from pagedkv.kernels.cpu import quant_linear as cpu_quant_linear
from pagedkv.kernels.quant_linear import QuantizedLinear, QuantizedMatrix
from pagedkv.worker_svc.model.config import load_model_config
from pagedkv.worker_svc.model.linear import Linear
from pagedkv.worker_svc.model.llama import LlamaModel
from pagedkv.worker_svc.model.weights import load_model
from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest

BLOCK = 16
PROMPT_LEN = 32


def read_bandwidth(reps: int) -> float:
    """Bytes per second of reading a 512 MiB fp32 buffer (best of ``reps`` sums)."""
    buf = torch.ones(128 * 1024 * 1024, dtype=torch.float32)
    best = float("inf")
    for _ in range(reps):
        t0 = time.perf_counter()
        buf.sum()
        best = min(best, time.perf_counter() - t0)
    return buf.numel() * 4 / best


def with_torch_ops(model: LlamaModel) -> LlamaModel:
    """A copy of a quantized ``model`` whose linear layers run PyTorch's int4 / int8 operators (the
    same integers; int4 also in torch's own layout, a private copy counted in no resident figure)."""
    copy = object.__new__(type(model))  # its family's forward (Gemma 3 is a subclass)
    for name in vars(model):
        setattr(copy, name, getattr(model, name))

    def torch_ops(lin: Linear) -> Linear:
        if lin.quantized is None or lin.quantized.kind == "kquant":  # no torch operator for K-quants
            return lin
        return Linear.build(lin.quantized, lin.bias, native=False)

    copy.lm_head = torch_ops(model.lm_head)
    copy.layers = [
        dataclasses.replace(
            layer, **{k: torch_ops(getattr(layer, k)) for k in ("qkv", "o", "gate_up", "down")}
        )
        for layer in model.layers
    ]
    return copy


def per_call(model: LlamaModel) -> LlamaModel:
    """A copy of ``model`` (the same weights) whose decode steps call every kernel from Python, one
    call each, instead of running the layers in one native call (``LlamaModel.chain_decode``)."""
    copy = object.__new__(type(model))  # its family's forward (Gemma 3 is a subclass)
    for name in vars(model):
        setattr(copy, name, getattr(model, name))
    copy.chain_decode = False
    return copy


@dataclass(slots=True)
class Decoder:
    """One sequence decoding on one model, a few steps per round."""

    label: str
    model: LlamaModel
    max_tokens: int
    runner: ModelRunner = field(init=False)
    table: list[int] = field(init=False)
    word_products: bool = True  # int4 / int8 as 16-bit integer products where the CPU has them
    seq_len: int = PROMPT_LEN
    token: int = 0
    times: list[float] = field(default_factory=list)
    reads: list[float] = field(default_factory=list)
    flat_reads: list[float] = field(default_factory=list)

    def __post_init__(self) -> None:
        cfg = self.model.cfg
        blocks = ceil_div(PROMPT_LEN + self.max_tokens + 1, BLOCK)
        shape = (cfg.num_layers, 2, blocks, BLOCK, cfg.num_kv_heads, cfg.head_dim)
        self.runner = ModelRunner(self.model, torch.zeros(shape), torch.zeros((*shape[:2], 1, *shape[3:])))
        self.table = list(range(blocks))
        prompt = [(7 * i + 3) % cfg.vocab_size for i in range(PROMPT_LEN)]
        self.token = self.runner.step([SequenceRequest("s", prompt, self.table, 0)]).outputs[0].token_id

    def steps(self, n: int) -> list[int]:
        out = []
        cpu_quant_linear.word_products(self.word_products)
        for _ in range(n):
            t0 = time.perf_counter()
            req = SequenceRequest("s", [self.token], self.table, self.seq_len)
            self.token = self.runner.step([req]).outputs[0].token_id
            self.times.append(time.perf_counter() - t0)
            self.seq_len += 1
            out.append(self.token)
        cpu_quant_linear.word_products(True)
        return out

    def plain_reads(self, reps: int, threads: int, flat: torch.Tensor) -> None:
        """Read the model's weight tensors ``reps`` times with no arithmetic, in a step's order, in
        one native call each (``cpu_native.read_spans``): the time the step's weights take to
        stream, the same bytes the floor counts, read as the step reads them; then the same bytes
        copied into one buffer (``flat``), read as one span the same number of times."""
        tensors = self.model.weight_tensors()
        for spans, times in (([flat], self.flat_reads), (tensors, self.reads)):
            for _ in range(reps):
                t0 = time.perf_counter()
                cpu_native.read_spans(spans, threads)
                times.append(time.perf_counter() - t0)


def weights_key(model: LlamaModel) -> int:
    """Which weights a model holds: its first tensor's address (the per-call and torch-op copies of a
    model hold the same tensors)."""
    return model.weight_tensors()[0].data_ptr()


def flat_copy(model: LlamaModel) -> torch.Tensor:
    """The bytes of ``model.weight_tensors()`` one after another in one new buffer."""
    return torch.cat([t.reshape(-1).view(torch.uint8) for t in model.weight_tensors()])


@dataclass(slots=True)
class LinearPass:
    """Every matrix of one kind once, through one kernel, at ``rows`` rows."""

    label: str
    nbytes: int
    calls: list[tuple[Callable[[torch.Tensor], torch.Tensor], torch.Tensor]]
    times: list[float] = field(default_factory=list)
    tiles: bool = True  # the AMX tiles on (where the CPU has them) while this pass runs

    def run(self) -> None:
        cpu_quant_linear.tile_products(self.tiles)
        try:
            t0 = time.perf_counter()
            for fn, x in self.calls:
                fn(x)
            self.times.append(time.perf_counter() - t0)
        finally:
            cpu_quant_linear.tile_products(True)


def linears(model: LlamaModel) -> list[Linear]:
    out = [model.lm_head]
    for layer in model.layers:
        out += [layer.qkv, layer.o, layer.gate_up, layer.down]
    return out


def linear_passes(dense: LlamaModel | None, quant: LlamaModel | None, rows: int) -> list[LinearPass]:
    """Per kernel, every matrix of the kind it takes (module docstring)."""
    passes: list[LinearPass] = []
    gen = torch.Generator().manual_seed(rows)

    def x_for(k: int) -> torch.Tensor:
        return torch.randn((rows, k), generator=gen)

    if dense is not None:
        lins = [lin for lin in linears(dense) if lin.native is not None]
        nbytes = sum(lin.weight.numel() * 4 for lin in lins)
        passes.append(
            LinearPass(
                f"native fp32 ({len(lins)} matrices)",
                nbytes,
                [(lin, x_for(lin.weight.shape[1])) for lin in lins],
            )
        )
    if quant is not None:
        seen: set[int] = set()
        mats: list[QuantizedMatrix] = []
        for lin in linears(quant):
            if lin.quantized is not None and lin.quantized.qweight.data_ptr() not in seen:
                seen.add(lin.quantized.qweight.data_ptr())
                mats.append(lin.quantized)
        for kind in ("int4", "int8", "kquant"):
            ms = [m for m in mats if m.kind == kind]
            if not ms:
                continue
            nbytes = sum(m.nbytes for m in ms)
            xs = [x_for(m.in_features) for m in ms]
            what = f"{len(ms)} matrices"
            native = [cpu_quant_linear.prepare(m) for m in ms]
            passes.append(LinearPass(f"native {kind} ({what})", nbytes, list(zip(native, xs, strict=True))))
            tiles = kind == "int4" and cpu_quant_linear.tile_products()
            if tiles:  # the row count choosing the path again (a prefill's: the dequantized panels)
                label = f"native {kind}, AMX tiles off ({what})"
                passes.append(LinearPass(label, nbytes, list(zip(native, xs, strict=True)), tiles=False))
            if kind != "kquant" and cpu_quant_linear.word_products():
                alone = [functools.partial(fn, arith=cpu_quant_linear.ARITH_ROWS) for fn in native]
                calls = list(zip(alone, xs, strict=True))
                passes.append(LinearPass(f"native {kind}, rows as alone ({what})", nbytes, calls))
                if tiles:
                    label = f"native {kind}, rows as alone, AMX tiles off ({what})"
                    passes.append(LinearPass(label, nbytes, calls, tiles=False))
            if kind == "kquant":
                continue
            ops = [QuantizedLinear.build(m, "torch") for m in ms]
            passes.append(LinearPass(f"torch {kind} op ({what})", nbytes, list(zip(ops, xs, strict=True))))
    return passes


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True)
    p.add_argument("--forms", nargs="+", default=["dense", "file"], choices=["dense", "file"])
    p.add_argument("--tokens", type=int, default=8, help="decode steps per model per round")
    p.add_argument("--rounds", type=int, default=4)
    p.add_argument("--reps", type=int, default=5, help="bandwidth sums; linear passes per round")
    p.add_argument("--rows", type=int, nargs="+", default=[1], help="rows of the linear-layer passes")
    p.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    torch.set_grad_enabled(False)
    cfg = load_model_config(args.model)
    models: dict[str, LlamaModel] = {}
    for form in args.forms:
        model = load_model(args.model, cfg, torch.float32, torch.device("cpu"), held=form)
        assert isinstance(model, LlamaModel)
        models[form] = model
    max_tokens = args.tokens * args.rounds
    decoders = []
    if "dense" in models:
        decoders.append(Decoder("fp32 (dense)", models["dense"], max_tokens))
    if "file" in models:
        decoders.append(Decoder("the file's own quantization", models["file"], max_tokens))
        decoders.append(
            Decoder("the file's own quantization, per-call layers", per_call(models["file"]), max_tokens)
        )
        int_layers = any(
            lin.quantized is not None and lin.quantized.kind in ("int4", "int8")
            for lin in linears(models["file"])
        )
        if int_layers and cpu_quant_linear.word_products():  # the same model, fp32 products on the same x
            decoders.append(
                Decoder(
                    "the file's own quantization, fp32 products",
                    models["file"],
                    max_tokens,
                    word_products=False,
                )
            )
        torch_has_op = any(
            lin.quantized is not None and lin.quantized.kind != "kquant" for lin in linears(models["file"])
        )
        if torch_has_op:  # else the copy would be the same model
            decoders.append(
                Decoder("the file's own quantization", with_torch_ops(models["file"]), max_tokens)
            )
    passes = {rows: linear_passes(models.get("dense"), models.get("file"), rows) for rows in args.rows}
    flats: dict[int, torch.Tensor] = {}  # one flat copy per set of weights (the model copies share theirs)
    for d in decoders:
        flats.setdefault(weights_key(d.model), flat_copy(d.model))
    bw = read_bandwidth(args.reps)
    tokens: dict[int, list[int]] = {id(d): [] for d in decoders}
    for _ in range(args.rounds):
        for d in decoders:
            tokens[id(d)] += d.steps(args.tokens)
            d.plain_reads(args.reps, args.threads, flats[weights_key(d.model)])
        for rows in args.rows:
            for _ in range(args.reps):
                for lp in passes[rows]:
                    lp.run()
    bw = max(bw, read_bandwidth(args.reps))
    print(
        f"read bandwidth {bw / 1e9:.1f} GB/s ({args.threads} threads, best of 2 x {args.reps}); "
        f"{args.rounds} rounds, alternating"
    )
    print()
    print(
        "| weights | linear path | resident MB | floor ms | plain read, one buffer ms "
        "| plain read, tensor by tensor ms | decode ms/token | / floor | / plain read | weight GB/s |"
    )
    print("|---|---|---:|---:|---:|---:|---:|---:|---:|---:|")
    for d in decoders:
        floor = d.model.weight_bytes / bw * 1e3
        step = statistics.median(d.times) * 1e3
        read = statistics.median(d.reads) * 1e3
        flat = statistics.median(d.flat_reads) * 1e3
        print(
            f"| {d.label} | {d.model.linear_path} | {d.model.weight_bytes / 1e6:.2f} | {floor:.3f} | "
            f"{flat:.3f} | {read:.3f} | {step:.2f} | {step / floor:.2f}x | {step / read:.2f}x | "
            f"{d.model.weight_bytes / step / 1e6:.2f} |"
        )
    quantized = [tokens[id(d)] for d in decoders if d.model.linear_path != "native"]
    if len(quantized) > 1:
        same = all(q == quantized[0] for q in quantized)
        print(
            f"\nthe file's model on every path (one call, per call, fp32 products, torch's ops), "
            f"same greedy tokens: {same}"
        )
    print()
    print("| linear kernel (the matrices it takes) | rows | resident MB | ms per pass | GB/s | / floor |")
    print("|---|---:|---:|---:|---:|---:|")
    for rows in args.rows:
        for lp in passes[rows]:
            t = statistics.median(lp.times)
            print(
                f"| {lp.label} | {rows} | {lp.nbytes / 1e6:.2f} | {t * 1e3:.3f} | "
                f"{lp.nbytes / t / 1e9:.2f} | {t / (lp.nbytes / bw):.2f}x |"
            )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
