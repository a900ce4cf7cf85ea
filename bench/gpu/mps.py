"""The prefill + decode layout under CUDA MPS: both roles' step times, from the workers themselves.

    python -m bench.gpu.mps                 # on a GPU machine (gpu_check.sh's mps section)
    python -m bench.gpu.mps --device cpu    # the CPU rehearsal: the same stack and report, no daemon

Why: the disaggregated layout runs its prefill and decode workers as separate processes on one GPU;
without MPS they time-slice it, with the MPS control daemon their kernels run side by side
(docs/worker.md "GPU: SM shares with CUDA MPS"). Nothing had run it: the daemon's pipe directory
(CUDA_MPS_PIPE_DIRECTORY, inherited by every worker), the same-UID rule and the start-up are what a
deployment depends on. This starts a private daemon (pipe and log directories of its own, so it
touches no daemon already running), runs bench/pd_bench.py's prefill+decode layout under it with the
workers at debug log level, and reports each role's steps from their own ``step`` events
(``forward_ms``: the forward pass the worker timed, per step). The daemon's server list proves the
workers were its clients; the daemon is stopped (``quit``) at the end.

Exit 0 when the layout ran (and, on CUDA, under a daemon that served it); 3 with the reason when the
container cannot run a daemon (no ``nvidia-cuda-mps-control``, or it does not start): gpu_check.sh
shows that as SKIPPED, not as a failure.
"""

from __future__ import annotations

import argparse
import json
import os
import pathlib
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field

from bench import pd_bench

SKIP = 3


class Unavailable(Exception):
    """Why no MPS daemon can run here (the section is skipped with this reason)."""


@dataclass(slots=True)
class RoleSteps:
    """One worker's steps, read from its log."""

    name: str
    role: str
    forward_ms: list[float] = field(default_factory=list)
    tokens: int = 0


def _control(cmd: str, env: dict[str, str], timeout: float = 5.0) -> str:
    proc = subprocess.run(
        ["nvidia-cuda-mps-control"],
        input=cmd + "\n",
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    if proc.returncode != 0:
        raise Unavailable(
            f"nvidia-cuda-mps-control {cmd!r} failed (rc={proc.returncode}): {proc.stderr.strip()}"
        )
    return proc.stdout.strip()


@contextmanager
def mps_daemon(work: pathlib.Path) -> Iterator[dict[str, str]]:
    """A private MPS control daemon; yields the environment its clients need (set in os.environ)."""
    if shutil.which("nvidia-cuda-mps-control") is None:
        raise Unavailable("no nvidia-cuda-mps-control on PATH: this image cannot run an MPS daemon")
    pipe, logs = work / "mps-pipe", work / "mps-log"
    pipe.mkdir(parents=True)
    logs.mkdir(parents=True)
    env = dict(os.environ, CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    start = subprocess.run(
        ["nvidia-cuda-mps-control", "-d"], env=env, capture_output=True, text=True, timeout=10
    )
    if start.returncode != 0:
        raise Unavailable(
            f"the MPS control daemon did not start (rc={start.returncode}): {start.stderr.strip()}"
        )
    try:
        _control("get_server_list", env)  # answers once the daemon is up
    except (Unavailable, subprocess.TimeoutExpired) as e:
        log = (logs / "control.log").read_text()[-800:] if (logs / "control.log").exists() else ""
        raise Unavailable(f"the MPS control daemon does not answer: {e} {log}") from e
    saved = {k: os.environ.get(k) for k in ("CUDA_MPS_PIPE_DIRECTORY", "CUDA_MPS_LOG_DIRECTORY")}
    os.environ.update(CUDA_MPS_PIPE_DIRECTORY=str(pipe), CUDA_MPS_LOG_DIRECTORY=str(logs))
    try:
        yield env
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        try:
            _control("quit", env)
        except (Unavailable, subprocess.TimeoutExpired) as e:
            print(f"stopping the MPS daemon: {e}", file=sys.stderr)


def role_steps(log_dir: pathlib.Path, roles: tuple[str, ...]) -> list[RoleSteps]:
    """Each worker's ``step`` events (JSON log lines) from DIR/worker-N.log."""
    out = []
    for i, role in enumerate(roles):
        steps = RoleSteps(f"worker-{i}", role)
        path = log_dir / f"worker-{i}.log"
        for line in path.read_text().splitlines() if path.exists() else []:
            try:
                rec = json.loads(line)
            except ValueError:
                continue
            if rec.get("event") == "step" and "forward_ms" in rec:
                steps.forward_ms.append(float(rec["forward_ms"]))
                steps.tokens += int(rec.get("num_tokens", 0))
        out.append(steps)
    return out


def table(title: str, rows: list[RoleSteps]) -> str:
    lines = [
        title,
        "",
        "| role | worker | steps | tokens computed | forward p50 ms | forward p99 ms | forward total ms |",
        "|---|---|---:|---:|---:|---:|---:|",
    ]
    for r in rows:
        p50, p99 = pd_bench.pct(r.forward_ms, 50), pd_bench.pct(r.forward_ms, 99)
        lines.append(
            f"| {r.role} | {r.name} | {len(r.forward_ms)} | {r.tokens} | {p50:.2f} | {p99:.2f} | "
            f"{sum(r.forward_ms):.1f} |"
        )
    return "\n".join(lines)


def run(
    args: argparse.Namespace, tmp: pathlib.Path, probe: Callable[[], str] = lambda: ""
) -> tuple[list[RoleSteps], str]:
    """The layout, driven once; ``probe`` runs while its workers still run (the MPS server list)."""
    roles = ("prefill", "decode")
    layout = pd_bench.Layout("prefill+decode", 2, roles=roles, worker_args=("--log-level", "debug"))
    model = pd_bench.make_model(tmp / "model", args.hidden, args.layers, args.vocab)
    load = argparse.Namespace(
        seed=0,
        decoders=args.decoders,
        decode_prompt=32,
        decode_tokens=args.decode_tokens,
        long=args.long,
        long_prompt=args.long_prompt,
        long_tokens=8,
        long_start_s=0.1,
        long_every_s=0.2,
    )
    log_dir = tmp / "logs"
    with pd_bench.running(layout, model, args.num_gpu_blocks, log_dir, args.device, args.dtype) as stack:
        result = pd_bench.drive(stack, pd_bench.workload(load, args.vocab), layout, 2048)
        seen = probe()
    print(
        f"generated {result.generated} tokens in {result.wall_s:.2f} s ({result.tok_s:.1f} tok/s)", flush=True
    )
    rows = role_steps(log_dir / layout.name, roles)
    missing = [r.role for r in rows if not r.forward_ms]
    if missing:
        raise RuntimeError(f"no step events in the logs of the {', '.join(missing)} worker(s)")
    return rows, seen


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--dtype", default=None, help="default: bfloat16 on cuda, float32 on cpu")
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--vocab", type=int, default=8192)
    ap.add_argument("--decoders", type=int, default=16)
    ap.add_argument("--decode-tokens", type=int, default=32)
    ap.add_argument("--long", type=int, default=2)
    ap.add_argument("--long-prompt", type=int, default=1024)
    ap.add_argument("--num-gpu-blocks", type=int, default=2048)
    args = ap.parse_args(argv)
    cuda = args.device.startswith("cuda")
    args.dtype = args.dtype or ("bfloat16" if cuda else "float32")
    what = f"hidden {args.hidden} x {args.layers} layers, {args.dtype} on {args.device}"
    with tempfile.TemporaryDirectory(prefix="pagedkv-mps-") as name:
        tmp = pathlib.Path(name)
        if not cuda:
            print("MPS: not started (CPU rehearsal: no GPU); the layout and the report run as on the GPU")
            rows, _ = run(args, tmp)
            print(table(f"## prefill + decode, each role's steps (CPU rehearsal, no MPS; {what})", rows))
            return 0
        try:
            with mps_daemon(tmp) as env:
                rows, servers = run(args, tmp, lambda: _control("get_server_list", env))
        except Unavailable as e:
            print(f"SKIPPED: {e}")
            return SKIP
        if not servers:
            print("the MPS daemon served no client: the workers did not run under MPS")
            return 1
        print(f"MPS server(s): {servers.replace(chr(10), ', ')}")
        print(table(f"## prefill + decode under CUDA MPS, each role's steps ({what})", rows))
    return 0


if __name__ == "__main__":
    pd_bench.exit_on_sigterm()
    raise SystemExit(main())
