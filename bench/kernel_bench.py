"""Benchmark the paged-attention kernels against the hardware ceiling and a no-paging baseline.

Why: paging is only worth it if reading K/V through block tables costs (almost) nothing. So every
number here is set against two references measured on the same machine: the device-to-device
copy bandwidth (the ceiling for a memory-bound kernel) and ``scaled_dot_product_attention`` on
contiguous K/V (the same attention without paging, with torch's best backend).

Sections (each runs on its own; a failure is reported and the rest go on):
  copy_bw      device-to-device copy bandwidth (read + write bytes / time): the ceiling
  decode       paged decode, batch x context grid, vs SDPA on contiguous KV
  prefill      paged prefill (full prompts and chunks after a cached prefix) vs SDPA
  write_kv     write_kv_cache bandwidth
  copy_blocks  copy_blocks bandwidth (all layers, one launch)
  swap         swap_blocks GPU <-> pinned CPU bandwidth (scattered blocks)

On a GPU: timings are ``triton.testing.do_bench`` medians, which flush L2 before every run; GB/s
and % ceiling come from those only. Decode also reports CUDA-graph medians ("graph ms": no launch
overhead, but L2 NOT flushed, so KV smaller than the ~60 MB L2 may be read from it), compared only
with each other ("paged/sdpa (graph)"). ``--smoke`` runs tiny sizes on CPU (Triton interpreter vs the
torch reference) so this code path is exercised without a GPU; its numbers mean nothing.

Results: a markdown table on stdout (last) and, with ``--out DIR`` or ``$OUT``, ``results.md`` and
``results.json`` there. Extend by adding a ``section_*`` function and listing it in ``SECTIONS``.
"""

from __future__ import annotations

import argparse
import functools
import json
import math
import os
import statistics
import sys
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.nn.functional as F

if not torch.cuda.is_available():
    # The interpreter must be chosen before the kernels' @triton.jit decorators run.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from pagedkv import kernels  # noqa: E402 - after TRITON_INTERPRET is chosen

Row = dict[str, Any]


@dataclass
class Bench:
    """Shared state: device, timer, budget and collected rows per section."""

    device: torch.device
    smoke: bool
    max_gib: float
    deadline: float
    dtypes: list[torch.dtype]
    tables: dict[str, list[Row]] = field(default_factory=dict)
    errors: list[str] = field(default_factory=list)
    ceiling_gbs: float | None = None

    @property
    def cuda(self) -> bool:
        return self.device.type == "cuda"

    def out_of_time(self) -> bool:
        return time.monotonic() > self.deadline

    def time_ms(self, fn: Callable[[], object]) -> float:
        """Median milliseconds of ``fn``: do_bench on CUDA, a few wall-clock runs on CPU."""
        if self.cuda:
            import triton.testing

            try:
                return float(triton.testing.do_bench(fn, warmup=10, rep=50, return_mode="median"))
            except TypeError:  # older triton without return_mode
                return float(triton.testing.do_bench(fn, warmup=10, rep=50, quantiles=[0.5])[0])
        fn()
        samples = []
        for _ in range(2 if self.smoke else 5):
            t0 = time.perf_counter()
            fn()
            samples.append((time.perf_counter() - t0) * 1e3)
        return statistics.median(samples)

    def graph_ms(self, fn: Callable[[], object]) -> float | None:
        """Median under CUDA graphs (no launch overhead), or None where unavailable."""
        if not self.cuda:
            return None
        import triton.testing

        try:
            try:
                return float(triton.testing.do_bench_cudagraph(fn, rep=50, return_mode="median"))
            except TypeError:
                return float(triton.testing.do_bench_cudagraph(fn, rep=50, quantiles=[0.5])[0])
        except Exception:  # capture can fail (e.g. a backend that syncs): report no number
            return None

    def elapsed_ms(self, fn: Callable[[], object]) -> float:
        """Milliseconds of one run of ``fn`` until its device work is done: CUDA events on a GPU
        (no device-wide synchronize), the wall clock on CPU."""
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            return (time.perf_counter() - t0) * 1e3
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        end.synchronize()
        return float(start.elapsed_time(end))

    def free(self) -> None:
        if self.cuda:
            torch.cuda.empty_cache()


def _gb_per_s(nbytes: float, ms: float) -> float:
    return nbytes / (ms * 1e-3) / 1e9


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).replace("torch.", "")


def _sdpa_best(b: Bench, run: Callable[[], torch.Tensor]) -> tuple[float, str]:
    """SDPA's time with its best backend: the default choice and each backend forced in turn."""
    best, name = math.inf, "none"
    candidates: list[tuple[str, Any]] = [("default", None)]
    if b.cuda:
        try:
            from torch.nn.attention import SDPBackend

            candidates += [
                ("flash", SDPBackend.FLASH_ATTENTION),
                ("cudnn", SDPBackend.CUDNN_ATTENTION),
                ("efficient", SDPBackend.EFFICIENT_ATTENTION),
            ]
        except ImportError:
            pass
    for label, backend in candidates:
        try:
            if backend is None:
                ms = b.time_ms(run)
            else:
                from torch.nn.attention import sdpa_kernel

                def forced(backend: Any = backend) -> torch.Tensor:
                    with sdpa_kernel(backend):
                        return run()

                ms = b.time_ms(forced)
        except Exception:
            continue
        if ms < best:
            best, name = ms, label
    return best, name


def _sdpa_fn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    scale: float,
    call: Callable[..., torch.Tensor],
    expand_ok: bool,
) -> Callable[[], torch.Tensor]:
    """SDPA with native GQA (enable_gqa) when this torch/backend takes it, else with K/V expanded
    to all query heads (more memory traffic than needed: noted as a weaker baseline)."""
    try:
        call(q, k, v, scale=scale, enable_gqa=True)
        return lambda: call(q, k, v, scale=scale, enable_gqa=True)
    except Exception:
        if not expand_ok:
            raise
        group = q.shape[1] // k.shape[1]
        ke = k.repeat_interleave(group, dim=1)
        ve = v.repeat_interleave(group, dim=1)
        print("[kernel_bench] SDPA without enable_gqa: K/V expanded per query head", file=sys.stderr)
        return lambda: call(q, ke, ve, scale=scale)


# ----------------------------------------------------------------------------- sections


def section_copy_bw(b: Bench) -> list[Row]:
    """Device-to-device copy: the bandwidth ceiling for memory-bound kernels."""
    nbytes = (1 << 20) * (4 if b.smoke else 1024)  # 1 GiB on GPU
    src = torch.empty(nbytes, dtype=torch.uint8, device=b.device).random_(0, 255)
    dst = torch.empty_like(src)
    ms = b.time_ms(lambda: dst.copy_(src))
    gbs = _gb_per_s(2 * nbytes, ms)  # read + write
    b.ceiling_gbs = gbs
    return [{"bytes": nbytes, "ms": ms, "GB/s (r+w)": gbs}]


def _paged_decode_inputs(
    b: Bench, batch: int, ctx: int, heads: int, kv_heads: int, dim: int, block: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    gen = torch.Generator(device=b.device).manual_seed(batch * 7 + ctx)
    nb_per = math.ceil(ctx / block)
    num_blocks = batch * nb_per
    shape = (num_blocks, block, kv_heads, dim)
    kc = torch.randn(shape, generator=gen, device=b.device, dtype=dtype)
    vc = torch.randn(shape, generator=gen, device=b.device, dtype=dtype)
    perm = torch.randperm(num_blocks, generator=gen, device=b.device)
    bt = perm.view(batch, nb_per).to(torch.int32)
    seq_lens = torch.full((batch,), ctx, dtype=torch.int32, device=b.device)
    q = torch.randn((batch, heads, dim), generator=gen, device=b.device, dtype=dtype)
    return {"kc": kc, "vc": vc, "bt": bt, "seq_lens": seq_lens, "q": q}


def _contiguous(cache: torch.Tensor, bt: torch.Tensor, ctx: int) -> torch.Tensor:
    """Gather a paged cache into [batch, kv_heads, ctx, dim] (a strided view of [b, ctx, h, d])."""
    batch = bt.shape[0]
    g = cache[bt.long()]  # [batch, nb_per, block, h, d]
    g = g.view(batch, -1, cache.shape[2], cache.shape[3])[:, :ctx]
    return g.transpose(1, 2)


def section_decode(b: Bench) -> list[Row]:
    if b.smoke:
        grid = [(1, 64), (2, 160)]
        heads, kv_heads, dim, block = 4, 2, 64, 16
    else:
        grid = [(bs, ctx) for bs in (1, 16, 64, 256) for ctx in (1024, 4096, 16384)]
        heads, kv_heads, dim, block = 32, 8, 128, 16
    rows: list[Row] = []
    for dtype in b.dtypes:
        for batch, ctx in grid:
            if b.out_of_time():
                rows.append(
                    {"dtype": _dtype_name(dtype), "batch": batch, "ctx": ctx, "note": "skipped: time budget"}
                )
                continue
            kv_bytes = 2 * batch * ctx * kv_heads * dim * torch.finfo(dtype).bits // 8
            if 2 * kv_bytes > b.max_gib * 2**30:  # paged + contiguous copies
                rows.append(
                    {"dtype": _dtype_name(dtype), "batch": batch, "ctx": ctx, "note": "skipped: memory"}
                )
                continue
            rows.append(_decode_case(b, batch, ctx, heads, kv_heads, dim, block, dtype, kv_bytes))
            b.free()
    return rows


def _decode_case(
    b: Bench,
    batch: int,
    ctx: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
    kv_bytes: int,
) -> Row:
    x = _paged_decode_inputs(b, batch, ctx, heads, kv_heads, dim, block, dtype)
    scale = dim**-0.5

    def paged() -> torch.Tensor:
        return kernels.paged_decode_attention(
            x["q"], x["kc"], x["vc"], x["bt"], x["seq_lens"], scale, max_seq_len=ctx
        )

    row: Row = {"dtype": _dtype_name(dtype), "batch": batch, "ctx": ctx}
    if b.smoke:
        with kernels.use_backend("triton"):
            out = paged()
            row["paged ms"] = b.time_ms(paged)
        with kernels.use_backend("reference"):
            ref = paged()
            row["reference ms"] = b.time_ms(paged)
        row["max err vs ref"] = float((out.float() - ref.float()).abs().max())
    else:
        out = paged()
        row["paged ms"] = b.time_ms(paged)
        row["paged graph ms"] = b.graph_ms(paged)
    # Bandwidth from the L2-flushed timing only: do_bench clears L2 before each run, CUDA-graph
    # replays do not, and a KV smaller than the H200's ~60 MB L2 would read partly from L2 there.
    row["GB/s"] = _gb_per_s(kv_bytes, row["paged ms"])
    if b.ceiling_gbs:
        row["% ceiling"] = 100.0 * row["GB/s"] / b.ceiling_gbs
    # No-paging baseline: the same attention on contiguous K/V through SDPA.
    k = _contiguous(x["kc"], x["bt"], ctx)
    v = _contiguous(x["vc"], x["bt"], ctx)
    q4 = x["q"].unsqueeze(2)  # [batch, heads, 1, dim]

    try:
        sdpa = _sdpa_fn(
            q4,
            k,
            v,
            scale,
            lambda q_, k_, v_, **kw: F.scaled_dot_product_attention(q_, k_, v_, **kw),
            expand_ok=2 * kv_bytes * heads // kv_heads < b.max_gib * 2**30,
        )
        base = sdpa().squeeze(2)
        row["max err vs sdpa"] = float((out.float() - base.float()).abs().max())
        row["sdpa ms"], row["sdpa backend"] = _sdpa_best(b, sdpa)
        row["sdpa graph ms"] = b.graph_ms(sdpa)
        row["paged/sdpa"] = row["paged ms"] / row["sdpa ms"]
        if row.get("paged graph ms") and row.get("sdpa graph ms"):
            row["paged/sdpa (graph)"] = row["paged graph ms"] / row["sdpa graph ms"]
    except Exception as exc:  # e.g. no enable_gqa in an old torch
        row["note"] = f"sdpa failed: {type(exc).__name__}: {exc}"[:120]
    return row


def section_prefill(b: Bench) -> list[Row]:
    """Full prompts and chunked prefill over a cached prefix, vs SDPA with a bottom-right causal mask."""
    if b.smoke:
        cases = [(1, 0, 40), (2, 30, 20)]
        heads, kv_heads, dim, block = 4, 2, 64, 16
    else:
        cases = [(1, 0, 4096), (4, 0, 2048), (1, 3584, 512), (8, 8192, 512), (1, 15360, 1024)]
        heads, kv_heads, dim, block = 32, 8, 128, 16
    rows: list[Row] = []
    for dtype in b.dtypes:
        for batch, prefix, chunk in cases:
            if b.out_of_time():
                rows.append(
                    {
                        "dtype": _dtype_name(dtype),
                        "batch": batch,
                        "prefix": prefix,
                        "chunk": chunk,
                        "note": "skipped: time budget",
                    }
                )
                continue
            rows.append(_prefill_case(b, batch, prefix, chunk, heads, kv_heads, dim, block, dtype))
            b.free()
    return rows


def _prefill_case(
    b: Bench,
    batch: int,
    prefix: int,
    chunk: int,
    heads: int,
    kv_heads: int,
    dim: int,
    block: int,
    dtype: torch.dtype,
) -> Row:
    seq = prefix + chunk
    x = _paged_decode_inputs(b, batch, seq, heads, kv_heads, dim, block, dtype)
    gen = torch.Generator(device=b.device).manual_seed(seq)
    q = torch.randn((batch * chunk, heads, dim), generator=gen, device=b.device, dtype=dtype)
    qsl = torch.arange(0, batch * chunk + 1, chunk, dtype=torch.int32, device=b.device)
    scale = dim**-0.5

    def paged() -> torch.Tensor:
        return kernels.paged_prefill_attention(
            q, x["kc"], x["vc"], x["bt"], qsl, x["seq_lens"], scale, max_query_len=chunk
        )

    row: Row = {"dtype": _dtype_name(dtype), "batch": batch, "prefix": prefix, "chunk": chunk}
    if b.smoke:
        with kernels.use_backend("triton"):
            out = paged()
            row["paged ms"] = b.time_ms(paged)
        with kernels.use_backend("reference"):
            row["max err vs ref"] = float((out.float() - paged().float()).abs().max())
            row["reference ms"] = b.time_ms(paged)
    else:
        out = paged()
        row["paged ms"] = b.time_ms(paged)
    # Causal FLOPs: query i (at position prefix + i) sees prefix + i + 1 keys; QK^T and PV.
    keys_seen = chunk * prefix + chunk * (chunk + 1) / 2
    row["TFLOP/s"] = 4 * dim * heads * batch * keys_seen / (row["paged ms"] * 1e-3) / 1e12
    k = _contiguous(x["kc"], x["bt"], seq)
    v = _contiguous(x["vc"], x["bt"], seq)
    q4 = q.view(batch, chunk, heads, dim).transpose(1, 2)

    def causal(q_: torch.Tensor, k_: torch.Tensor, v_: torch.Tensor, **kw: Any) -> torch.Tensor:
        if prefix == 0:
            return F.scaled_dot_product_attention(q_, k_, v_, is_causal=True, **kw)
        from torch.nn.attention.bias import causal_lower_right  # queries are the LAST chunk tokens

        return F.scaled_dot_product_attention(q_, k_, v_, attn_mask=causal_lower_right(chunk, seq), **kw)

    try:
        sdpa = _sdpa_fn(q4, k, v, scale, causal, expand_ok=True)
        base = sdpa().transpose(1, 2).reshape(batch * chunk, heads, dim)
        row["max err vs sdpa"] = float((out.float() - base.float()).abs().max())
        row["sdpa ms"], row["sdpa backend"] = _sdpa_best(b, sdpa)
        row["paged/sdpa"] = row["paged ms"] / row["sdpa ms"]
    except Exception as exc:
        row["note"] = f"sdpa failed: {type(exc).__name__}: {exc}"[:120]
    return row


def section_write_kv(b: Bench) -> list[Row]:
    tokens, kv_heads, dim, block = (40, 2, 64, 16) if b.smoke else (16384, 8, 128, 16)
    rows: list[Row] = []
    for dtype in b.dtypes:
        num_blocks = 2 * tokens // block
        kc = torch.empty((num_blocks, block, kv_heads, dim), dtype=dtype, device=b.device)
        vc = torch.empty_like(kc)
        key = torch.randn((tokens, kv_heads, dim), dtype=dtype, device=b.device)
        value = torch.randn_like(key)
        slots = torch.randperm(num_blocks * block, device=b.device)[:tokens]
        ms = b.time_ms(functools.partial(kernels.write_kv_cache, key, value, kc, vc, slots))
        nbytes = 2 * 2 * key.numel() * key.element_size()  # K and V, read + write
        rows.append(
            {"dtype": _dtype_name(dtype), "tokens": tokens, "ms": ms, "GB/s (r+w)": _gb_per_s(nbytes, ms)}
        )
    return rows


def section_copy_blocks(b: Bench) -> list[Row]:
    layers, pairs_n, kv_heads, dim, block = (2, 4, 2, 64, 16) if b.smoke else (32, 256, 8, 128, 16)
    rows: list[Row] = []
    for dtype in b.dtypes[:1]:
        num_blocks = 4 * pairs_n
        big = torch.randn((layers, 2, num_blocks, block, kv_heads, dim), dtype=dtype, device=b.device)
        kcs = [big[i, 0] for i in range(layers)]
        vcs = [big[i, 1] for i in range(layers)]
        perm = torch.randperm(num_blocks)
        pairs = torch.stack([perm[:pairs_n], perm[pairs_n : 2 * pairs_n]], dim=1).to(b.device)
        ms = b.time_ms(functools.partial(kernels.copy_blocks, kcs, vcs, pairs))
        nbytes = 2 * layers * 2 * pairs_n * block * kv_heads * dim * big.element_size()
        rows.append(
            {
                "dtype": _dtype_name(dtype),
                "layers": layers,
                "pairs": pairs_n,
                "ms": ms,
                "GB/s (r+w)": _gb_per_s(nbytes, ms),
            }
        )
    return rows


def section_swap(b: Bench) -> list[Row]:
    if not b.cuda:
        return [{"note": "skipped: needs CUDA (GPU <-> pinned CPU)"}]
    blocks, n, kv_heads, dim, block = 4096, 1024, 8, 128, 16
    dtype = b.dtypes[0]
    gpu = torch.randn((blocks, block, kv_heads, dim), dtype=dtype, device=b.device)
    cpu = torch.empty((blocks, block, kv_heads, dim), dtype=dtype).pin_memory()
    perm = torch.randperm(blocks)
    pairs = torch.stack([perm[:n], torch.randperm(blocks)[:n]], dim=1)
    nbytes = n * block * kv_heads * dim * gpu.element_size()
    rows: list[Row] = []
    for name, fn in (
        ("gpu->cpu", lambda: kernels.swap_blocks(gpu, cpu, pairs)),
        ("cpu->gpu", lambda: kernels.swap_blocks(cpu, gpu, pairs)),
    ):
        reps = 5
        ms = b.elapsed_ms(lambda fn=fn, reps=reps: [fn() for _ in range(reps)]) / reps
        rows.append(
            {"direction": name, "blocks": n, "MiB": nbytes / 2**20, "ms": ms, "GB/s": _gb_per_s(nbytes, ms)}
        )
    return rows


SECTIONS: dict[str, Callable[[Bench], list[Row]]] = {
    "copy_bw": section_copy_bw,
    "decode": section_decode,
    "prefill": section_prefill,
    "write_kv": section_write_kv,
    "copy_blocks": section_copy_blocks,
    "swap": section_swap,
}


# ----------------------------------------------------------------------------- output


def _fmt(v: Any) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        if v == 0 or abs(v) >= 100:
            return f"{v:.0f}" if abs(v) >= 100 else "0"
        if abs(v) >= 1:
            return f"{v:.2f}"
        return f"{v:.3g}"
    return str(v)


def to_markdown(b: Bench) -> str:
    lines = [f"# kernel_bench ({'smoke, CPU' if b.smoke else torch.cuda.get_device_name(b.device)})", ""]
    if b.ceiling_gbs:
        lines += [f"Copy-bandwidth ceiling: {b.ceiling_gbs:.0f} GB/s (read + write)", ""]
    for name, rows in b.tables.items():
        lines += [f"## {name}", ""]
        cols: list[str] = []
        for r in rows:
            cols += [c for c in r if c not in cols]
        lines.append("| " + " | ".join(cols) + " |")
        lines.append("|" + "---|" * len(cols))
        for r in rows:
            lines.append("| " + " | ".join(_fmt(r.get(c)) for c in cols) + " |")
        lines.append("")
    if b.errors:
        lines += ["## errors", ""] + [f"- {e}" for e in b.errors] + [""]
    return "\n".join(lines)


def section_deadline(now: float, end: float, sections_left: int) -> float:
    """When the section starting ``now`` stops starting cases: an equal share of what is left.

    Why shares: the decode grid alone can fill any budget, and with one deadline for all the
    prefill rows (and everything after) read "skipped: time budget". A section that finishes
    early passes its unused time on to the ones after it."""
    return now + max(0.0, end - now) / max(1, sections_left)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--smoke", action="store_true", help="tiny sizes on CPU: interpreter vs reference")
    ap.add_argument(
        "--sections", default=",".join(SECTIONS), help="comma-separated subset of " + ",".join(SECTIONS)
    )
    ap.add_argument("--dtypes", default=None, help="comma-separated: float16,bfloat16,float32")
    ap.add_argument("--max-gib", type=float, default=40.0, help="skip cases needing more device memory")
    ap.add_argument(
        "--time-budget",
        type=float,
        default=200.0,
        help="seconds for all sections: each gets an equal share of what is left when it starts "
        "and skips its remaining cases after that",
    )
    ap.add_argument("--out", default=os.environ.get("OUT"), help="directory for results.md / results.json")
    args = ap.parse_args(argv)

    device = torch.device("cuda" if torch.cuda.is_available() and not args.smoke else "cpu")
    if device.type == "cpu" and not args.smoke:
        print("no CUDA device: running in --smoke mode", file=sys.stderr)
        args.smoke = True
    default_dtypes = "float32,float16" if args.smoke else "float16,bfloat16"
    dtypes = [getattr(torch, d) for d in (args.dtypes or default_dtypes).split(",")]
    end = time.monotonic() + args.time_budget
    b = Bench(device, args.smoke, args.max_gib, end, dtypes)
    names = args.sections.split(",")
    for i, name in enumerate(names):
        fn = SECTIONS.get(name)
        if fn is None:
            b.errors.append(f"unknown section {name!r}")
            continue
        t0 = time.monotonic()
        b.deadline = section_deadline(t0, end, len(names) - i)
        try:
            b.tables[name] = fn(b)
        except Exception as exc:  # keep going: one broken section must not hide the others
            traceback.print_exc()
            b.errors.append(f"{name}: {type(exc).__name__}: {exc}")
        finally:
            b.free()
        print(f"[kernel_bench] {name}: {time.monotonic() - t0:.1f}s", file=sys.stderr)
    md = to_markdown(b)
    if args.out:
        out = Path(args.out)
        out.mkdir(parents=True, exist_ok=True)
        (out / "results.md").write_text(md + "\n")
        (out / "results.json").write_text(
            json.dumps(
                {"ceiling_gbs": b.ceiling_gbs, "tables": b.tables, "errors": b.errors}, indent=1, default=str
            )
        )
    print(md)
    return 1 if b.errors else 0


if __name__ == "__main__":
    sys.exit(main())
