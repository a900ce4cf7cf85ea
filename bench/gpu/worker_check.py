#!/usr/bin/env python
"""GPU check for the worker: one KV cache shared over CUDA IPC by separate processes, and decode
throughput.

    python -m bench.gpu.worker_check [--out results/gpu_check] [--dtype bfloat16]

1. Multi-process (the same scenario as tests/worker_svc/test_processes.py, on CUDA): a cache host
   (`pagedkv cache-host --device cuda`) and two workers attached by CUDA IPC. Worker A prefills
   three prompts, worker B decodes them, B is SIGKILLed and restarted, a swap-out/swap-in round
   trip runs through the cache ops, and A finishes. The tokens must equal a single-process run of
   the same model and kernels on a private cache. Then workers stop, the host stops, and /dev/shm
   must hold none of its segments.
2. Throughput: decode steps (forward + sampling, in process, Triton kernels) for several batch
   sizes on a Llama-shaped model with random weights; prints a tokens/s table (markdown) and
   writes worker_bench.json / worker_bench.md under --out.

Runs on CPU too (`--device cpu`, shared memory, tiny sizes) as a smoke test of the script itself.
Exit code 0 only if the multi-process check passed.

Built to run under bench/gpu_check.sh's section timeout: ``--deadline-s`` bounds every wait (a
child that does not come up fails the check instead of outliving the section), results are written
after each phase (a check cut short still leaves what finished), SIGTERM kills the roles it started
before exiting, and the service imports (protos, structlog, pydantic) happen inside the check, so
an image without them reports the ImportError as the check's result instead of crashing.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import signal
import subprocess
import sys
import threading
import time

import torch

from pagedkv.arith import ceil_div

ROOT = pathlib.Path(__file__).resolve().parents[2]

BLOCK = 16
T0 = time.monotonic()
DEADLINE_S = 600.0  # set from --deadline-s
LIVE: list[Proc] = []  # roles started and not yet reaped: killed on SIGTERM / exit


def time_left() -> float:
    return DEADLINE_S - (time.monotonic() - T0)


class Proc:
    """A `pagedkv` role as a subprocess; JSON log lines from stderr, waited on by event name."""

    def __init__(self, args: list[str], env: dict[str, str]) -> None:
        self.p = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.cli", *args, "--log-format", "json"],
            cwd=ROOT,
            env=env,
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
        LIVE.append(self)
        self.records: list[dict] = []
        self.raw: list[str] = []
        threading.Thread(target=self._read, daemon=True).start()

    def _read(self) -> None:
        assert self.p.stderr is not None
        for line in self.p.stderr:
            self.raw.append(line)
            try:
                self.records.append(json.loads(line))
            except ValueError:
                pass

    def wait_event(self, event: str, timeout: float = 180.0) -> dict:
        deadline = time.monotonic() + min(timeout, max(0.0, time_left()))
        while time.monotonic() < deadline:
            for r in list(self.records):
                if r.get("event") == event:
                    return r
            if self.p.poll() is not None:
                time.sleep(0.2)
                for r in list(self.records):
                    if r.get("event") == event:
                        return r
                break
            time.sleep(0.05)
        raise RuntimeError(f"no {event!r} (rc={self.p.poll()}):\n{''.join(self.raw)[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM) -> int:
        if self.p.poll() is None:
            self.p.send_signal(sig)
        try:
            return self.p.wait(max(1.0, min(30.0, time_left())))
        except subprocess.TimeoutExpired:
            self.p.kill()
            return self.p.wait(5)


def kill_all() -> None:
    """SIGKILL every role still running (used on SIGTERM and at exit): nothing is orphaned."""
    for p in reversed(LIVE):
        if p.p.poll() is None:
            p.p.kill()
            try:
                p.p.wait(5)
            except subprocess.TimeoutExpired:
                pass


def _step_request(seqs: list[tuple[str, list[int], list[int], int]]):  # noqa: ANN202
    from pagedkv.v1 import worker_pb2

    return worker_pb2.WorkerStepRequest(
        sequences=[
            worker_pb2.SequenceInput(seq_id=s, token_ids=t, block_ids=b, num_cached_tokens=c)
            for s, t, b, c in seqs
        ]
    )


def multi_process_check(device: str, dtype: str) -> dict:
    try:
        return _multi_process_check(device, dtype)
    except Exception as e:  # noqa: BLE001 - e.g. an ImportError on an image without the service deps
        return {"ok": False, "error": f"{type(e).__name__}: {e}"}


def _multi_process_check(device: str, dtype: str) -> dict:
    import grpc

    from pagedkv.v1 import block_manager_pb2, worker_pb2_grpc
    from pagedkv.worker_svc.model.config import DEFAULT_MODEL_CONFIG
    from pagedkv.worker_svc.model.weights import load_model
    from pagedkv.worker_svc.model_runner import CacheOpsRequest, ModelRunner, SequenceRequest

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    prompts = [[(7 * i + j) % 250 + 1 for j in range(n)] for i, n in enumerate((21, 40, 9))]
    tables = [list(range(10 * i, 10 * i + 10)) for i in range(3)]  # room for 160 tokens each
    n_decode = 24

    # --- the single-process reference: same model, same kernels, a private cache ---------------
    dev = torch.device(device)
    tdtype = getattr(torch, dtype)
    cfg = DEFAULT_MODEL_CONFIG
    model = load_model(None, cfg, tdtype, dev, seed=0)
    gpu = torch.zeros(
        (cfg.num_layers, 2, 64, BLOCK, cfg.num_kv_heads, cfg.head_dim), dtype=tdtype, device=dev
    )
    cpu = torch.zeros((cfg.num_layers, 2, 16, BLOCK, cfg.num_kv_heads, cfg.head_dim), dtype=tdtype)
    runner = ModelRunner(model, gpu, cpu)

    def local(
        seqs: list[tuple[str, list[int], list[int], int]], ops: CacheOpsRequest | None = None
    ) -> list[int]:
        reqs = [SequenceRequest(s, t, b, c) for s, t, b, c in seqs]
        return [o.token_id for o in runner.step(reqs, ops).outputs]

    # --- the deployment: cache host + workers A, B (+ B') ------------------------------------------
    common = [
        "--device",
        device,
        "--dtype",
        dtype,
        "--block-size",
        str(BLOCK),
        "--num-gpu-blocks",
        "64",
        "--num-cpu-blocks",
        "16",
    ]
    host = Proc(["cache-host", "--port", "0", *common, "--shm-prefix", "pagedkv-gpucheck"], env)
    procs = [host]
    result: dict = {"ok": False}
    try:
        ready = host.wait_event("cache_host_ready")
        segments = [s for s in (ready.get("gpu_segment"), ready.get("cpu_segment")) if s]
        target = f"127.0.0.1:{ready['port']}"
        a = Proc(["worker", "--port", "0", "--cache-host", target, *common], env)
        b = Proc(["worker", "--port", "0", "--cache-host", target, *common], env)
        procs += [a, b]
        stub_a = worker_pb2_grpc.WorkerStub(
            grpc.insecure_channel(f"127.0.0.1:{a.wait_event('worker_ready')['port']}")
        )
        stub_b = worker_pb2_grpc.WorkerStub(
            grpc.insecure_channel(f"127.0.0.1:{b.wait_event('worker_ready')['port']}")
        )
        result["backend"] = ready["backend"]

        def remote(stub, seqs, ops=None) -> list[int]:  # noqa: ANN001
            req = _step_request(seqs)
            if ops is not None:
                req.ops.CopyFrom(
                    block_manager_pb2.CacheOps(
                        swap_out=[block_manager_pb2.BlockCopy(src=s, dst=d) for s, d in ops.swap_out],
                        swap_in=[block_manager_pb2.BlockCopy(src=s, dst=d) for s, d in ops.swap_in],
                    )
                )
            return [o.token_id for o in stub.Step(req, timeout=max(1.0, time_left())).outputs]

        hist = [list(p) for p in prompts]
        cached = [0, 0, 0]
        got_remote: list[list[int]] = [[], [], []]
        got_local: list[list[int]] = [[], [], []]
        swap_step = n_decode // 2

        def step(stub, ops=None) -> None:  # noqa: ANN001
            seqs = [(f"s{i}", hist[i][cached[i] :], tables[i], cached[i]) for i in range(3)]
            r = remote(stub, seqs, ops)
            loc = local(seqs, ops)
            for i in range(3):
                cached[i] = len(hist[i])
                hist[i].append(r[i])
                got_remote[i].append(r[i])
                got_local[i].append(loc[i])

        step(stub_a)  # prefill on A
        for k in range(n_decode):
            if k == n_decode // 3:  # crash B and replace it
                b.stop(signal.SIGKILL)
                b = Proc(["worker", "--port", "0", "--cache-host", target, *common], env)
                procs.append(b)
                stub_b = worker_pb2_grpc.WorkerStub(
                    grpc.insecure_channel(f"127.0.0.1:{b.wait_event('worker_ready')['port']}")
                )
            ops = None
            if k == swap_step:  # swap seq 0 out to CPU blocks and back in to other GPU blocks
                used = ceil_div(cached[0], BLOCK)
                new_table = list(range(30, 30 + 10))
                ops = CacheOpsRequest(swap_out=list(zip(tables[0][:used], range(used), strict=False)))
                remote(stub_a, [], ops)
                local([], ops)
                ops = CacheOpsRequest(swap_in=list(zip(range(used), new_table[:used], strict=False)))
                tables[0] = new_table
            step(stub_b if k < 2 * n_decode // 3 else stub_a, ops)
        result["tokens_equal"] = got_remote == got_local
        result["tokens"] = got_remote
        for p in procs[1:]:
            p.stop()
        result["host_rc"] = host.stop()
        time.sleep(0.2)
        result["leaked_segments"] = [s for s in segments if pathlib.Path("/dev/shm", s).exists()]
        result["ok"] = bool(
            result["tokens_equal"] and result["host_rc"] == 0 and not result["leaked_segments"]
        )
    except Exception as e:  # noqa: BLE001 - report, don't crash the check
        result["error"] = f"{type(e).__name__}: {e}"
    finally:
        for p in reversed(procs):
            if p.p.poll() is None:
                p.stop(signal.SIGKILL)
    return result


def throughput(
    device: str, dtype: str, batches: list[int], ctx: int, steps: int, shape: dict, on_row=None
) -> list[dict]:  # noqa: ANN001
    """Decode step time per batch size; stops starting new batch sizes when the deadline is near."""
    from pagedkv.worker_svc.model.config import ModelConfig
    from pagedkv.worker_svc.model.llama import LlamaModel
    from pagedkv.worker_svc.model.weights import expected_names, expected_shapes
    from pagedkv.worker_svc.model_runner import ModelRunner, SequenceRequest

    cfg = ModelConfig(**shape, name="bench")
    dev, tdtype = torch.device(device), getattr(torch, dtype)
    gen = torch.Generator(device=dev).manual_seed(0)
    shapes = expected_shapes(cfg)
    weights = {}
    for n in expected_names(cfg):
        t = torch.randn(shapes[n], generator=gen, device=dev, dtype=torch.float32) * (
            0.02 if "norm" not in n else 0.0
        )
        weights[n] = (t + (1.0 if "norm" in n else 0.0)).to(tdtype)
    model = LlamaModel(cfg, weights)
    max_b = max(batches)
    blocks_per_seq = ceil_div(ctx + steps + 1, BLOCK)
    gpu = torch.zeros(
        (cfg.num_layers, 2, max_b * blocks_per_seq, BLOCK, cfg.num_kv_heads, cfg.head_dim),
        dtype=tdtype,
        device=dev,
    )
    runner = ModelRunner(
        model, gpu, torch.zeros((cfg.num_layers, 2, 0, BLOCK, cfg.num_kv_heads, cfg.head_dim), dtype=tdtype)
    )
    rows = []
    for bsz in batches:
        if rows and time_left() < 2 * rows[-1]["seconds"] + 5:
            print(f"deadline: batch {bsz} and larger not measured", flush=True)
            break
        t_batch = time.perf_counter()
        tables = [list(range(i * blocks_per_seq, (i + 1) * blocks_per_seq)) for i in range(bsz)]
        chunk = max(1, 8192 // ctx)
        for i0 in range(0, bsz, chunk):  # prefill in chunks to bound activation memory
            runner.step(
                [
                    SequenceRequest(f"s{i}", [(i + j) % cfg.vocab_size for j in range(ctx)], tables[i], 0)
                    for i in range(i0, min(bsz, i0 + chunk))
                ]
            )
        last = [1] * bsz
        times = []
        for k in range(steps):
            reqs = [SequenceRequest(f"s{i}", [last[i]], tables[i], ctx + k) for i in range(bsz)]
            t0 = (
                time.perf_counter()
            )  # the previous step's work is done: step() returns its tokens on the host
            res = runner.step(reqs)
            times.append(time.perf_counter() - t0)
            last = [o.token_id for o in res.outputs]
        times = sorted(times[2:]) or times  # drop warm-up
        med = times[len(times) // 2]
        rows.append(
            {
                "batch": bsz,
                "context": ctx,
                "step_ms_p50": med * 1e3,
                "tokens_per_s": bsz / med,
                "seconds": time.perf_counter() - t_batch,
            }
        )
        if on_row is not None:
            on_row(rows)
        print(f"batch {bsz:4d} ctx {ctx}: {med * 1e3:8.2f} ms/step  {bsz / med:10.0f} tok/s", flush=True)
    return rows


def write_results(out: pathlib.Path, mp: dict, rows: list[dict]) -> None:
    """(Re)write worker_bench.md / .json with everything measured so far."""
    md = ["# worker GPU check", ""]
    if mp:
        md += [
            f"multi-process shared cache over {mp.get('backend', '?')}: "
            f"{'PASS' if mp['ok'] else 'FAIL'} {'' if mp['ok'] else mp.get('error', '') or mp}",
            "",
        ]
    else:
        md += ["multi-process shared cache: not finished", ""]
    if rows:
        md += ["| batch | context | step p50 (ms) | tokens/s |", "|---:|---:|---:|---:|"]
        md += [
            f"| {r['batch']} | {r['context']} | {r['step_ms_p50']:.2f} | {r['tokens_per_s']:.0f} |"
            for r in rows
        ]
    (out / "worker_bench.md").write_text("\n".join(md) + "\n")
    (out / "worker_bench.json").write_text(json.dumps({"multi_process": mp, "throughput": rows}, indent=1))


def main() -> int:
    global DEADLINE_S
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--out", default="results/gpu_check")
    ap.add_argument("--batches", default=None, help="comma-separated decode batch sizes")
    ap.add_argument("--context", type=int, default=None)
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--skip-throughput", action="store_true")
    ap.add_argument(
        "--deadline-s",
        type=float,
        default=600.0,
        help="every wait and phase ends within this many seconds of the start",
    )
    args = ap.parse_args()
    DEADLINE_S = args.deadline_s
    signal.signal(signal.SIGTERM, lambda *_: (kill_all(), sys.exit(124)))
    cuda = args.device.startswith("cuda")
    dtype = args.dtype or ("bfloat16" if cuda else "float32")
    out = pathlib.Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    mp: dict = {}
    rows: list[dict] = []
    try:
        print(f"== multi-process shared cache ({args.device}, {dtype})", flush=True)
        mp = multi_process_check(args.device, dtype)
        print(json.dumps({k: v for k, v in mp.items() if k != "tokens"}), flush=True)
        write_results(out, mp, rows)
        if not args.skip_throughput:
            shape = (
                dict(
                    vocab_size=32000,
                    hidden_size=2048,
                    intermediate_size=8192,
                    num_layers=16,
                    num_heads=32,
                    num_kv_heads=8,
                    head_dim=64,
                )
                if cuda
                else dict(
                    vocab_size=256,
                    hidden_size=64,
                    intermediate_size=128,
                    num_layers=2,
                    num_heads=4,
                    num_kv_heads=2,
                    head_dim=16,
                )
            )
            batches = [int(x) for x in (args.batches or ("1,8,32,64,128,256" if cuda else "1,4")).split(",")]
            ctx = args.context or (512 if cuda else 32)
            print(f"== decode throughput ({args.device}, {dtype}, model {shape})", flush=True)
            try:
                rows = throughput(
                    args.device,
                    dtype,
                    batches,
                    ctx,
                    args.steps,
                    shape,
                    on_row=lambda r: write_results(out, mp, r),
                )
            except Exception as e:  # noqa: BLE001 - keep the rows measured before the failure
                print(f"throughput failed: {type(e).__name__}: {e}", flush=True)
                rows = json.loads((out / "worker_bench.json").read_text())["throughput"]
    finally:
        kill_all()
        write_results(out, mp, rows)
    print((out / "worker_bench.md").read_text(), flush=True)
    return 0 if mp.get("ok") else 1


if __name__ == "__main__":
    sys.exit(main())
