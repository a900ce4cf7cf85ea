"""What a model's weights cost a running stack: `pagedkv up` with N workers, proportional set size.

Starts the stack of `pagedkv up --model FILE --num-workers N --num-gpu-blocks B` (block manager,
cache host, workers as processes), generates a few tokens so that every weight page is touched,
sums PSS (each shared page split among the processes mapping it) over all its processes, and
does the same for the built-in tiny model. The difference is what the model's weights cost; the
script prints it beside the file's tensor bytes and each worker's reported `weight_bytes`.

    python -m bench.weights_memory --model FILE.gguf [--weight-format auto fp32] [--num-workers 2]
"""

from __future__ import annotations

import argparse
import io
import os
import pathlib
import tempfile
from collections.abc import Sequence

from frontend.clients.block_manager import BlockManagerClient
from frontend.clients.worker import WorkerClient
from frontend.engine import Engine, EngineConfig, GenerationRequest
from frontend.launch.config import StackConfig
from frontend.launch.processes import Stack
from pagedkv.ports import free_port_block
from worker_svc.model import gguf_file, model_source


def pss_kib(pid: int) -> int:
    """Proportional set size of a process (kB, /proc/PID/smaps_rollup)."""
    for line in pathlib.Path(f"/proc/{pid}/smaps_rollup").read_text().splitlines():
        if line.startswith("Pss:"):
            return int(line.split()[1])
    raise ValueError(f"no Pss line for process {pid}")


def measure(
    model: str | None, weight_format: str, workers: int, blocks: int, log_dir: str
) -> tuple[int, list[int]]:
    """PSS (bytes) of the whole stack after a short generation, and each worker's weight_bytes."""
    base = free_port_block(2 + workers)
    opts = StackConfig(
        block_manager_port=base,
        cache_host_port=base + 1,
        worker_port=base + 2,
        num_workers=workers,
        num_gpu_blocks=blocks,
        model=model,
        device="cpu",
        weight_format=weight_format,
        log_format="json",
        log_dir=log_dir,
        shm_prefix=f"pagedkv-wmem-{os.getpid()}",
    )
    stack = Stack(opts, out=io.StringIO())
    try:
        stack.start()
        bm = BlockManagerClient(f"127.0.0.1:{base}")
        clients = [WorkerClient(f"127.0.0.1:{base + 2 + i}") for i in range(workers)]
        try:
            engine = Engine(bm, clients, EngineConfig(max_num_seqs=workers))
            # One request per worker (a batch of one goes to one worker): every worker reads every weight.
            reqs = [GenerationRequest(f"w{i}", [1 + i, 2, 3, 4], max_tokens=4) for i in range(2 * workers)]
            engine.generate(reqs)
            weight_bytes = [int(c.get_info().weight_bytes) for c in clients]
            engine.close()
        finally:
            bm.close()
            for c in clients:
                c.close()
        per = {}
        for svc in stack.services:
            assert svc.process is not None
            per[svc.name] = pss_kib(svc.process.pid) * 1024
        print(
            f"  {model or 'tiny'} {weight_format}: PSS MiB "
            + ", ".join(f"{n} {b / 2**20:.0f}" for n, b in per.items())
        )
        return sum(per.values()), weight_bytes
    finally:
        stack.stop()


def file_tensor_bytes(model: str) -> int:
    src = model_source.resolve(model)
    if src.kind != "gguf":
        return sum(p.stat().st_size for p in pathlib.Path(src.path).glob("*.safetensors"))
    header = gguf_file.read_header(src.path)
    return sum(gguf_file.tensor_bytes(t) for t in header.tensors.values())


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--model", required=True, help="GGUF file or Hugging Face directory")
    p.add_argument("--weight-format", nargs="+", default=["auto"], help="one row per format")
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--num-gpu-blocks", type=int, default=64)
    args = p.parse_args(argv)
    logs = tempfile.mkdtemp(prefix="pagedkv-wmem-logs-")
    mib = 1024 * 1024
    file_bytes = file_tensor_bytes(args.model)
    tiny, _ = measure(None, "auto", args.num_workers, args.num_gpu_blocks, f"{logs}/tiny")
    print(f"model {pathlib.Path(args.model).name}: {file_bytes / mib:.1f} MiB of tensors in the file")
    print(f"built-in tiny model, {args.num_workers} workers: stack PSS {tiny / mib:.0f} MiB")
    print(
        "| weight format | stack PSS MiB | over the tiny model MiB | over / file | worker weight_bytes MiB |"
    )
    print("|---|---:|---:|---:|---:|")
    for fmt in args.weight_format:
        total, wb = measure(args.model, fmt, args.num_workers, args.num_gpu_blocks, f"{logs}/{fmt}")
        extra = total - tiny
        print(
            f"| {fmt} | {total / mib:.0f} | {extra / mib:.0f} | {extra / file_bytes:.2f}x | "
            f"{', '.join(f'{b / mib:.1f}' for b in wb)} |"
        )
    print(f"(service logs: {logs})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
