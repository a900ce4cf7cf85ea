"""What a model costs the stack a user starts: `pagedkv up --model FILE`, proportional set size.

Starts the stack ``pagedkv up --model FILE`` runs with no flags (``pagedkv.frontend.launch.processes
.up_config``, planned from this machine: bench/up_stack.py adds only free ports, logs and a
shared-memory prefix), sends a few requests at once to its OpenAI front door (two per worker:
serve's engine splits a step's sequences over the workers, so every weight is read), and sums PSS
(each shared page split among the processes mapping it) over every process of the stack: block
manager, cache host, workers and serve, each shown. It does the same for the built-in tiny
model's default stack (``pagedkv up`` with no ``--model``); the difference is what the model costs
the stack, printed as a multiple of the file's size (the target: at most 2x), beside the file's
tensor bytes and each worker's reported ``weight_bytes``.

Every ``--weight-format`` other than ``auto`` is a row of its own, labelled with that flag
(``pagedkv up --model FILE --weight-format fp32``), over the same tiny baseline. ``--num-workers N``
adds the same rows for ``pagedkv up ... --num-workers N`` (and its own tiny baseline), labelled so.

    python -m bench.weights_memory --model FILE.gguf [--weight-format auto fp32] [--num-workers N]
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import sys
import tempfile
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

from pagedkv.frontend.clients.http import post_json
from pagedkv.frontend.clients.worker import WorkerClient
from pagedkv.frontend.launch.processes import Stack
from pagedkv.worker_svc.model import gguf_file, model_source

MIB = 1 << 20


def pss_kib(pid: int) -> int:
    """Proportional set size of a process (kB, /proc/PID/smaps_rollup)."""
    for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise ValueError(f"no Pss line for process {pid}")


def measure(model: str | None, flags: Sequence[str], log_dir: str) -> tuple[dict[str, int], list[int]]:
    """PSS (bytes) of each process of the stack ``pagedkv up [--model MODEL] FLAGS`` after a short
    generation over HTTP, by service name, and each worker's weight_bytes."""
    from bench import up_stack

    opts = up_stack.up_options(model, flags, log_dir=log_dir, shm_prefix=f"pagedkv-wmem-{os.getpid()}")
    stack = Stack(opts, out=io.StringIO())
    try:
        stack.start()
        url = f"http://127.0.0.1:{opts.serve_port}/v1/completions"
        n = 2 * opts.num_workers

        def send(i: int) -> None:
            body = {"prompt": [1 + i, 2, 3, 4], "max_tokens": 4, "temperature": 0, "ignore_eos": True}
            post_json(url, body)

        with ThreadPoolExecutor(max_workers=n) as pool:
            list(pool.map(send, range(n)))
        clients = [WorkerClient(f"127.0.0.1:{opts.worker_port + i}") for i in range(opts.num_workers)]
        try:
            weight_bytes = [int(c.get_info().weight_bytes) for c in clients]
        finally:
            for c in clients:
                c.close()
        per = {}
        for svc in stack.services:
            assert svc.process is not None
            per[svc.name] = pss_kib(svc.process.pid) * 1024
        print(
            f"  {up_stack.label(flags)} {model or 'tiny'}: {up_stack.describe(opts)}; PSS MiB "
            + ", ".join(f"{n} {b / MIB:.0f}" for n, b in per.items()),
            file=sys.stderr,
            flush=True,
        )
        return per, weight_bytes
    finally:
        leaked = stack.stop()
        if leaked:
            print(f"weights_memory: shared memory left behind: {leaked}", file=sys.stderr)


def file_tensor_bytes(model: str) -> int:
    src = model_source.resolve(model)
    if src.kind != "gguf":
        return sum(p.stat().st_size for p in pathlib.Path(src.path).glob("*.safetensors"))
    header = gguf_file.read_header(src.path)
    return sum(gguf_file.tensor_bytes(t) for t in header.tensors.values())


def file_bytes(model: str) -> int:
    """The model's size on disk: the GGUF file, or a directory's safetensors."""
    path = pathlib.Path(model)
    if path.is_file():
        return path.stat().st_size
    return sum(p.stat().st_size for p in path.glob("*.safetensors"))


def main(argv: Sequence[str] | None = None) -> int:
    from bench import up_stack

    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file or Hugging Face directory")
    p.add_argument(
        "--weight-format",
        nargs="+",
        default=["auto"],
        help="one row per format (auto: the default stack; another: its `--weight-format` row)",
    )
    p.add_argument(
        "--num-workers",
        type=int,
        default=None,
        help="also the rows of `pagedkv up ... --num-workers N` (default: the plan's workers only)",
    )
    args = p.parse_args(argv)
    logs = tempfile.mkdtemp(prefix="pagedkv-wmem-logs-")
    size, tensors = file_bytes(args.model), file_tensor_bytes(args.model)
    print(
        f"model {pathlib.Path(args.model).name}: {size / MIB:.1f} MiB on disk, {tensors / MIB:.1f} MiB of "
        "tensors; each stack is the one `pagedkv up` starts with the flags in its row's name"
    )
    extras: list[list[str]] = [[]] + ([["--num-workers", str(args.num_workers)]] if args.num_workers else [])
    rows: list[tuple[str, str, dict[str, int], int | None, list[int]]] = []
    for extra in extras:
        tiny, _ = measure(None, extra, f"{logs}/tiny{len(rows)}")
        baseline = sum(tiny.values())
        rows.append((up_stack.label(extra), "built-in tiny model (baseline)", tiny, None, []))
        for fmt in args.weight_format:
            flags = [*extra, *([] if fmt == "auto" else ["--weight-format", fmt])]
            per, wb = measure(args.model, flags, f"{logs}/{fmt}{len(rows)}")
            rows.append((up_stack.label(flags), f"the file, {fmt}", per, baseline, wb))
    names = list(dict.fromkeys(name for row in rows for name in row[2]))  # the services, in start order
    print(
        "| stack | model | stack PSS MiB | "
        + " | ".join(f"{'serve' if n == 'frontend' else n} MiB" for n in names)
        + " | over the tiny model MiB | over / file size | over / file tensors | worker weight_bytes MiB |"
    )
    print("|---|---|---:|" + "---:|" * len(names) + "---:|---:|---:|---:|")
    for label, what, per, base, wb in rows:
        total = sum(per.values())
        cells = [
            label,
            what,
            f"{total / MIB:.0f}",
            *(f"{per[n] / MIB:.0f}" if n in per else "-" for n in names),
        ]
        if base is None:
            cells += ["", "", "", ""]
        else:
            extra_bytes = total - base
            cells += [
                f"{extra_bytes / MIB:.0f}",
                f"{extra_bytes / size:.2f}x",
                f"{extra_bytes / tensors:.2f}x",
                ", ".join(f"{b / MIB:.1f}" for b in wb),
            ]
        print("| " + " | ".join(cells) + " |")
    for label, what, per, base, _ in rows:
        if base is not None:
            growth = (sum(per.values()) - base) / size
            verdict = "within" if growth <= 2.0 else "over"
            print(
                f"{label} ({what}): the stack grows by {growth:.2f}x the file's size "
                f"({verdict} the 2x target)"
            )
    print(f"(service logs: {logs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
