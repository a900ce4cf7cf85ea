"""`pagedkv up`: the whole stack as local processes, started, watched and stopped together.

Block manager first (it owns the geometry), then the cache host (reads the
geometry from it and allocates the cache once), then N workers (attach to the
cache host's memory). Each is a separate `pagedkv <role>` process bound to
127.0.0.1 unless told otherwise; `up` waits for every gRPC health check to say
SERVING, prints where each listens, and on Ctrl-C / SIGTERM stops them in
reverse order (frontend, workers, cache host, block manager) and checks that no
shared memory segment was left behind in /dev/shm. Last comes the OpenAI-compatible
frontend, `pagedkv serve` on port 8000 (docs/serve.md), checked on its HTTP /health.

A service that exits is restarted (frontend/launch/supervisor.py: backoff, at most
--max-restarts-per-minute restarts of one service, then the stack stops naming it). The block
manager journals to a state dir (--state-dir DIR, kept; by default a temporary one, removed when
`up` stops), so a restarted block manager comes back with every sequence and block.

`--tls-dir DIR --auth-tokens-file FILE` secures the whole stack: every server mutual TLS, every
server with tokens, and every connection between the roles with a client certificate and a token
(frontend/launch/security.py, docs/security.md); the frontend serves HTTPS with mutual TLS.
"""

from __future__ import annotations

import argparse
import os
import pathlib
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import NoReturn

from pagedkv import parent_watch, settings_file
from pagedkv.cpu_list import format_cpus
from pagedkv.cpu_runtime import preload_env, remove_openmp_registration
from pagedkv.frontend.launch import up_settings
from pagedkv.frontend.launch.config import StackConfig, override_flags, worker_roles
from pagedkv.frontend.launch.ready import ReadyService, StackReady
from pagedkv.frontend.launch.security import StackSecurity, StackSecurityError
from pagedkv.frontend.launch.supervisor import RestartPolicy, supervise
from pagedkv.frontend.launch.up_settings import HELP, PLANNED, UpSettings, layered_values
from pagedkv.frontend.serve.settings import ServeSettings
from pagedkv.healthcheck import wait_healthy
from pagedkv.logging_setup import configure_logging
from pagedkv.machine import Machine, this_machine
from pagedkv.plan import Asked, Plan, plan_stack
from pagedkv.settings_cli import HelpAll, LayeredParser, add_config_flag, add_flag, flag, to_argv
from pagedkv.step_channel import sweep_stale

SHM_DIR = pathlib.Path("/dev/shm")


@dataclass(slots=True)
class Service:
    name: str
    args: list[str]
    address: str
    health_service: str
    process: subprocess.Popen[bytes] | None = None
    health_url: str = ""  # HTTP services (the frontend): ready when this answers 200
    env: dict[str, str] = field(default_factory=dict)  # on top of the stack's environment


def _pagedkv(*args: str) -> list[str]:
    return [sys.executable, "-m", "pagedkv.cli", *args]


def plan(opts: StackConfig, security: StackSecurity | None = None, state_dir: str = "") -> list[Service]:
    """The processes to start, in start order (``state_dir``: the block manager's, when given)."""
    sec = security or StackSecurity()
    bm = f"{opts.host}:{opts.block_manager_port}"
    ch = f"{opts.host}:{opts.cache_host_port}"
    common = ["--log-format", opts.log_format, *sec.server_args()]
    dial = sec.dial_args()
    model = ["--model", opts.model] if opts.model else []
    if opts.speculative_model:  # every role that loads or asks for the draft model
        model += ["--speculative-model", opts.speculative_model]
    seed = ["--seed", str(opts.seed)]
    backend = ["--kernel-backend", opts.kernel_backend] if opts.kernel_backend else []
    services = [
        Service(
            "block-manager",
            _pagedkv(
                "block-manager",
                "--host",
                opts.host,
                "--port",
                str(opts.block_manager_port),
                *_pool_args(opts),
                *_kv_groups_args(opts),
                "--num-cpu-blocks",
                str(opts.num_cpu_blocks),
                "--block-size",
                str(opts.block_size),
                *(["--state-dir", state_dir, "--fsync", opts.fsync] if state_dir else []),
                *override_flags(opts.block_manager_overrides),
                *common,
            ),
            bm,
            "pagedkv.v1.BlockManager",
        ),
        Service(
            "cache-host",
            _pagedkv(
                "cache-host",
                "--host",
                opts.host,
                "--port",
                str(opts.cache_host_port),
                "--block-manager",
                bm,
                "--device",
                opts.device,
                "--dtype",
                opts.dtype,
                "--weight-format",
                opts.weight_format,
                "--shm-prefix",
                opts.shm_prefix,
                "--kv-cache-dtype",
                opts.kv_cache_dtype,
                *([] if opts.share_weights else ["--no-share-weights"]),
                *seed,
                *opts.cache_host_args,
                *model,
                *common,
                *dial,
            ),
            ch,
            "pagedkv.v1.CacheHost",
        ),
    ]
    roles = worker_roles(opts.roles, opts.num_workers)
    worker_env = preload_env() if opts.preload_runtime and _cpu_workers(opts.device) else {}
    placement = worker_placement(opts)
    for i in range(opts.num_workers):
        port = opts.worker_port + i
        services.append(
            Service(
                f"worker-{i}",
                _pagedkv(
                    "worker",
                    "--host",
                    opts.host,
                    "--port",
                    str(port),
                    "--cache-host",
                    ch,
                    "--block-manager",
                    bm,
                    "--device",
                    opts.device,
                    "--dtype",
                    opts.dtype,
                    "--weight-format",
                    opts.weight_format,
                    "--role",
                    roles[i],
                    "--kv-cache-dtype",
                    opts.kv_cache_dtype,
                    *placement[i][0],
                    *seed,
                    *backend,
                    *opts.worker_args,
                    *model,
                    *common,
                    *dial,
                ),
                f"{opts.host}:{port}",
                "pagedkv.v1.Worker",
                env={**worker_env, **placement[i][1]},
            )
        )
    if opts.serve_port is not None:
        workers = ",".join(s.address for s in services[2:])
        address = f"{opts.host}:{opts.serve_port}"
        scheme = "https" if sec.tls_dir else "http"
        services.append(
            Service(
                "frontend",
                _pagedkv(
                    "serve",
                    "--host",
                    opts.host,
                    "--port",
                    str(opts.serve_port),
                    "--block-manager",
                    bm,
                    "--workers",
                    workers,
                    "--kv-cache-dtype",
                    opts.kv_cache_dtype,
                    *model,
                    "--log-format",
                    opts.log_format,
                    *sec.frontend_args(),
                    *opts.serve_args,
                ),
                address,
                "http",
                health_url=f"{scheme}://{_loopback_for(opts.host)}:{opts.serve_port}/health",
                env=sec.frontend_env(),
            )
        )
    return services


def worker_placement(opts: StackConfig) -> list[tuple[list[str], dict[str, str]]]:
    """Each worker's placement flags (``--cpu-affinity``, ``--num-threads``) and environment: the
    plan's (``opts.placement``), else ``pin_workers``' even split of this machine's CPUs, else none.
    ``OMP_NUM_THREADS`` is the planned thread count too, so no OpenMP team in the worker (the native
    kernels', torch's, a library's) starts with one thread per CPU of the machine."""
    if opts.placement:
        if len(opts.placement) != opts.num_workers:
            raise ValueError(f"{len(opts.placement)} worker placements for {opts.num_workers} workers")
        out = []
        for w in opts.placement:
            pin = ["--cpu-affinity", format_cpus(w.cpus)] if w.cpus else []
            out.append(([*pin, "--num-threads", str(w.threads)], {"OMP_NUM_THREADS": str(w.threads)}))
        return out
    if opts.pin_workers:
        groups = split_cpus(sorted(os.sched_getaffinity(0)), opts.num_workers)
        return [
            (
                ["--cpu-affinity", format_cpus(g), "--num-threads", str(len(g))],
                {"OMP_NUM_THREADS": str(len(g))},
            )
            for g in groups
        ]
    return [([], {}) for _ in range(opts.num_workers)]


def _kv_groups(opts: StackConfig) -> str:
    """The block manager's --kv-groups for this stack's model (StackConfig.kv_groups: ``auto``
    derives them from the model's layers, worker_svc/model/kv_layout.py; empty: one group)."""
    from pagedkv.worker_svc.geometry import kv_groups_for

    return kv_groups_for(opts.model, opts.kv_groups)


def _kv_groups_args(opts: StackConfig) -> list[str]:
    spec = _kv_groups(opts)
    return ["--kv-groups", spec] if spec else []


def _pool_args(opts: StackConfig) -> list[str]:
    """The block manager's pool: its KV dtype, and a block count or a budget over this model's bytes
    per block (computed as the cache host checks it: worker_svc/geometry.py, imported only then)."""
    kv = ["--kv-cache-dtype", opts.kv_cache_dtype]
    if not opts.kv_cache_memory:
        return [*kv, "--num-gpu-blocks", str(opts.num_gpu_blocks)]
    from pagedkv.worker_svc.geometry import model_block_bytes

    per_block = model_block_bytes(
        opts.model,
        opts.dtype,
        opts.device,
        opts.block_size,
        opts.kv_cache_dtype,
        _kv_groups(opts),
        opts.speculative_model,
    )
    return [*kv, "--kv-cache-memory", str(opts.kv_cache_memory), "--kv-bytes-per-block", str(per_block)]


def _cpu_workers(device: str) -> bool:
    """Whether the workers will compute on the CPU: ``cpu``, or ``auto`` on a host without an
    NVIDIA driver (the preloads are for CPU compute; GPU workers keep torch's own runtime)."""
    return device == "cpu" or (device == "auto" and not pathlib.Path("/dev/nvidiactl").exists())


def split_cpus(cpus: Sequence[int], n: int) -> list[list[int]]:
    """This machine's CPUs in ``n`` disjoint, near-equal groups (workers share CPUs only when n > #CPUs)."""
    if n <= len(cpus):
        k = len(cpus) // n
        return [list(cpus[i * k : (i + 1) * k]) for i in range(n)]
    return [[cpus[i % len(cpus)]] for i in range(n)]


def _loopback_for(host: str) -> str:
    return "127.0.0.1" if host in ("0.0.0.0", "::", "") else host


def _http_ok(url: str, tls: dict[str, str] | None = None) -> tuple[bool, str]:
    import ssl
    import urllib.error
    import urllib.request

    ctx = None
    if url.startswith("https") and tls:
        ctx = ssl.create_default_context(cafile=tls["tls_ca"])
        ctx.load_cert_chain(tls["tls_cert"], tls["tls_key"])
    try:
        with urllib.request.urlopen(url, timeout=1.0, context=ctx) as r:  # noqa: S310 - our own loopback URL
            return r.status == 200, f"HTTP {r.status}"
    except urllib.error.HTTPError as e:
        return False, f"HTTP {e.code}"
    except OSError as e:
        return False, str(e)


def wait_serving(
    address: str,
    service: str,
    deadline: float,
    proc: subprocess.Popen[bytes],
    tls: dict[str, str] | None = None,
    health_url: str = "",
    interval_s: float = 0.2,
) -> None:
    """pagedkv.healthcheck.wait_healthy on the gRPC health check (over ``tls``: tls_ca/tls_cert/
    tls_key), or on the HTTP one at ``health_url``, until `deadline` (monotonic), asking every
    ``interval_s``."""
    probe = (lambda: _http_ok(health_url, tls)) if health_url else None
    wait_healthy(
        address,
        service,
        deadline - time.monotonic(),
        proc=proc,
        probe=probe,
        interval_s=interval_s,
        **(tls or {}),
    )


def launch(svc: Service, env: dict[str, str], log_path: pathlib.Path | None = None) -> None:
    """Start ``svc``'s process (``svc.process``) in a session of its own, so that a Ctrl-C meant for
    the starter is not also delivered to it, and told to stop should this process die without
    stopping it (pagedkv/parent_watch.py); its output appended to ``log_path`` when given."""
    out = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115 - owned by the child
    try:
        svc.process = subprocess.Popen(
            svc.args,
            env={**env, **svc.env, parent_watch.ENV: str(os.getpid())},  # it stops if we die
            stdout=out,
            stderr=out,
            start_new_session=True,
        )
    finally:
        if out is not None:
            out.close()  # the child has its own copy


def kill(svc: Service) -> None:
    """SIGKILL ``svc`` (if it runs) and reap it."""
    if svc.process is not None and svc.process.poll() is None:
        svc.process.kill()
        svc.process.wait()


def terminate(svc: Service, timeout_s: float) -> None:
    """SIGTERM ``svc`` (if it runs) and reap it; SIGKILL after ``timeout_s``."""
    p = svc.process
    if p is None or p.poll() is not None:
        return
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def leaked_segments(prefix: str) -> list[str]:
    if not SHM_DIR.is_dir():
        return []
    return sorted(p.name for p in SHM_DIR.iterdir() if p.name.startswith(prefix))


class Stack:
    """Start, watch and stop the services of one `pagedkv up`."""

    def __init__(self, opts: StackConfig, out: object = sys.stdout) -> None:
        self.opts = opts
        self.security = StackSecurity.prepare(
            opts.tls_dir, opts.auth_tokens_file, opts.allow_insecure
        )  # StackSecurityError
        # The block manager's journal and snapshots: what lets a restarted one keep every sequence.
        self.state_dir_is_temporary = opts.state_dir is None
        if opts.state_dir is None:
            self.state_dir = pathlib.Path(tempfile.mkdtemp(prefix="pagedkv-up-state-"))
        else:
            self.state_dir = pathlib.Path(opts.state_dir)
            self.state_dir.mkdir(parents=True, exist_ok=True)
        self.services: list[Service] = []
        try:
            self.services = plan(opts, self.security, str(self.state_dir))
        except BaseException:
            self.stop()  # nothing started yet: removes the temporary state dir, the security files
            raise
        self.out = out

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)  # type: ignore[call-overload]

    def _log_path(self, svc: Service) -> pathlib.Path | None:
        return pathlib.Path(self.opts.log_dir) / f"{svc.name}.log" if self.opts.log_dir else None

    def start(self) -> None:
        env = {**os.environ, **self.security.env()}
        if self.opts.log_dir:
            pathlib.Path(self.opts.log_dir).mkdir(parents=True, exist_ok=True)
        deadline = time.monotonic() + self.opts.ready_timeout_s
        try:
            for svc in self.services:
                launch(svc, env, self._log_path(svc))
                assert svc.process is not None
                wait_serving(
                    svc.address,
                    svc.health_service,
                    deadline,
                    svc.process,
                    self.security.client_tls(),
                    svc.health_url,
                )
                self._say(f"  {svc.name:<14} SERVING  {svc.address}  (pid {svc.process.pid})")
        except BaseException:
            self.stop()
            raise

    def restart(self, name: str, stop: threading.Event | None = None) -> Service:
        """Start service `name` again (it must have exited) and wait until it is SERVING, or until
        ``stop`` is set: what a supervisor does (frontend/launch/supervisor.py), e.g. for a cache host that
        died and the workers that then exit (code 3)."""
        svc = next(s for s in self.services if s.name == name)
        if svc.process is not None and svc.process.poll() is None:
            raise RuntimeError(f"{name} is still running (pid {svc.process.pid})")
        if svc.process is not None:
            remove_openmp_registration(svc.process.pid)
        launch(svc, {**os.environ, **self.security.env()}, self._log_path(svc))
        assert svc.process is not None
        deadline = time.monotonic() + self.opts.ready_timeout_s
        while True:  # in slices, so that Ctrl-C during a restart is not held up by the readiness wait
            try:
                wait_serving(
                    svc.address,
                    svc.health_service,
                    min(deadline, time.monotonic() + 1.0),
                    svc.process,
                    self.security.client_tls(),
                    svc.health_url,
                )
                return svc
            except TimeoutError:
                if stop is not None and stop.is_set():
                    return svc  # the caller is stopping the stack anyway
                if time.monotonic() >= deadline:
                    raise

    def ready(self) -> StackReady:
        """Where each started service listens, and its pid (``--ready-file``)."""
        frontend = next((s for s in self.services if s.name == "frontend"), None)
        return StackReady(
            services=tuple(
                ReadyService(s.name, s.address, s.process.pid) for s in self.services if s.process is not None
            ),
            url=frontend.health_url.removesuffix("/health") if frontend is not None else "",
            state_dir=str(self.state_dir),
        )

    def kill(self, name: str) -> None:
        """SIGKILL service `name` (one that hung while starting) and reap it."""
        kill(next(s for s in self.services if s.name == name))

    def first_exited(self) -> Service | None:
        for svc in self.services:
            if svc.process is not None and svc.process.poll() is not None:
                return svc
        return None

    def stop(self, timeout_s: float = 15.0) -> list[str]:
        """Stop in reverse order; returns shared-memory segments left behind (should be none)."""
        for svc in reversed(self.services):
            terminate(svc, timeout_s)
            if svc.process is not None:
                remove_openmp_registration(svc.process.pid)  # killed: the runtime's file stays
        self.security.close()
        if self.state_dir_is_temporary:
            shutil.rmtree(self.state_dir, ignore_errors=True)
        sweep_stale()  # the step-channel directory of a worker that was killed and not restarted
        return leaked_segments(self.opts.shm_prefix)


SHORT_DESCRIPTION = (
    "Start the block manager, cache host, workers and the OpenAI-compatible frontend as local processes, "
    "planned from this machine and the model; Ctrl-C stops them all."
)
EPILOG = (
    "Every setting is a flag, a PAGEDKV_* variable and a key of a --config file (flag > file > variable > "
    "default); this shows the common ones: `pagedkv up --help-all` lists every flag, docs/settings.md "
    "every setting of every role."
)


def build_parser(show_all: bool = False) -> argparse.ArgumentParser:
    """``pagedkv up``'s flags, from its settings (frontend/launch/up_settings.py) and the `pagedkv serve`
    settings it forwards; what no flag gives comes from ``--config FILE``, then the environment, then
    the defaults (``layered_values``). ``show_all``: every flag in the help, not only ``HELP``'s."""
    p = LayeredParser(
        prog="pagedkv up",
        usage="pagedkv up [--config FILE] [options]",
        description=__doc__ if show_all else SHORT_DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter if show_all else argparse.HelpFormatter,
        layers=layered_values,
    )
    add_config_flag(p, "up")
    p.add_argument(
        "--print-plan", action="store_true", help="print the plan (workers, cores, threads, KV) and exit"
    )
    p.add_argument(
        "--help-all",
        action=HelpAll,
        full=lambda: build_parser(show_all=True),
        help="show every flag and exit",
    )
    flags = [(n, n, f) for n, f in UpSettings.model_fields.items()]
    flags += [(f"serve_{n}", n, ServeSettings.model_fields[n]) for n in SERVE_FLAGS]
    if not show_all:  # the common ones first, in HELP's order
        flags.sort(key=lambda t: HELP.index(t[0]) if t[0] in HELP else len(HELP))
    frontend = (
        p.add_argument_group("frontend", "forwarded to `pagedkv serve` (docs/serve.md)") if show_all else p
    )
    for dest, name, spec in flags:
        target = frontend if dest.startswith("serve_") and name in SERVE_FLAGS else p
        hidden = not (show_all or dest in HELP)
        add_flag(target, name, spec, dest=dest, hidden=hidden, env=show_all, default=PLANNED.get(dest))
    return p


# `pagedkv serve` settings that `pagedkv up` forwards as flags (frontend/launch/up_settings.py).
SERVE_FLAGS = up_settings.SERVE_FLAGS


def refuse(message: str) -> NoReturn:
    """A value ``up`` cannot take: the message on stderr, exit status 2, as argparse's own errors
    and a bad settings file or variable (a mistake in what was asked, not a failure to run it)."""
    print(f"pagedkv up: {message}", file=sys.stderr, flush=True)
    raise SystemExit(2)


def serve_args(args: argparse.Namespace) -> tuple[str, ...]:
    """The frontend group's flags that were given, as `pagedkv serve` flags (checked as serve would)."""
    given = {name: getattr(args, f"serve_{name}") for name in SERVE_FLAGS}
    given = {k: v for k, v in given.items() if v is not None}
    try:
        ServeSettings.model_validate(given)
    except ValueError as e:
        refuse(str(e))
    if given.get("api_key_file") and not pathlib.Path(given["api_key_file"]).is_file():
        refuse(f"--api-key-file {given['api_key_file']}: no such file")
    out: list[str] = []
    for name, value in given.items():
        out += ["--" + name.replace("_", "-"), str(value)]
    return tuple(out)


def check_args(args: argparse.Namespace) -> None:
    """Each of ``up``'s values against its setting's type and bounds (SystemExit naming the flag):
    a flag's value is only converted by argparse; the file's and the environment's were checked
    when read, and pass again."""
    fields = [(n, n, f) for n, f in UpSettings.model_fields.items()]
    fields += [(f"serve_{n}", n, ServeSettings.model_fields[n]) for n in SERVE_FLAGS]
    for dest, name, spec in fields:
        value = getattr(args, dest, None)
        if value is None:
            continue
        try:
            settings_file.check(spec, value, strict=False)
        except ValueError as e:
            refuse(f"{flag(name)} {e}")


def plan_from_args(args: argparse.Namespace, machine: Machine | None = None) -> Plan:
    """The stack's plan on ``machine`` (default: this one) for the model and the flags given."""
    from pagedkv.worker_svc.geometry import kv_groups_for, model_size

    check_args(args)
    try:
        size = model_size(
            args.model,
            args.dtype,
            args.device,
            args.block_size,
            args.kv_cache_dtype,
            args.weight_format,
            kv_groups_for(args.model, args.kv_groups),
            args.speculative_model,
        )
        return plan_stack(
            machine or this_machine(),
            size,
            Asked(
                device=args.device,
                num_workers=args.num_workers,
                num_threads=args.num_threads,
                pin=args.pin_workers,
                kv_cache_memory_gib=args.kv_cache_memory,
                num_gpu_blocks=args.num_gpu_blocks,
                max_num_seqs=args.serve_max_num_seqs,
                processes=3 if args.serve else 2,
            ),
        )
    except (ValueError, FileNotFoundError) as e:  # PlanError; a model the reader refuses or lacks
        raise SystemExit(f"pagedkv up: {e}") from e


def options_from_args(args: argparse.Namespace, stack_plan: Plan | None = None) -> StackConfig:
    """The StackConfig of these flags, with what they leave open from ``stack_plan`` (default: the
    plan for this machine, ``plan_from_args``)."""
    check_args(args)
    stack_plan = stack_plan or plan_from_args(args)
    roles = tuple(r.strip() for r in args.roles.split(",") if r.strip())
    try:
        worker_roles(roles, stack_plan.num_workers)
    except ValueError as e:
        refuse(str(e))
    forwarded = serve_args(args)
    if args.serve_max_num_seqs is None:
        forwarded += ("--max-num-seqs", str(stack_plan.max_num_seqs))
    # The settings file's other settings of each role, passed on to each of its processes.
    role_settings: dict[str, dict[str, object]] = getattr(args, "role_settings", {})
    forwarded += tuple(to_argv(role_settings.get("serve", {})))
    return StackConfig(
        host=args.host,
        block_manager_port=args.block_manager_port,
        cache_host_port=args.cache_host_port,
        worker_port=args.worker_port,
        num_workers=stack_plan.num_workers,
        placement=stack_plan.workers,
        num_gpu_blocks=stack_plan.num_gpu_blocks,
        num_cpu_blocks=args.num_cpu_blocks,
        kv_cache_dtype=args.kv_cache_dtype,
        # A budget asked in GiB goes to the block manager as such (it divides by the bytes per
        # block, which the cache host checks); a planned one is already whole blocks.
        kv_cache_memory=args.kv_cache_memory or 0.0,
        kv_groups=args.kv_groups,
        block_size=args.block_size,
        model=args.model,
        speculative_model=args.speculative_model,
        device=args.device,
        dtype=args.dtype,
        weight_format=args.weight_format,
        log_format=args.log_format,
        log_dir=args.log_dir,
        ready_timeout_s=args.ready_timeout_s,
        roles=roles,
        pin_workers=args.pin_workers,
        preload_runtime=args.preload_runtime,
        tls_dir=args.tls_dir,
        auth_tokens_file=args.auth_tokens_file,
        allow_insecure=args.allow_insecure,
        serve_port=args.serve_port if args.serve else None,
        serve_args=forwarded,
        block_manager_overrides=dict(role_settings.get("block-manager", {})),
        cache_host_args=tuple(to_argv(role_settings.get("cache-host", {}))),
        worker_args=tuple(to_argv(role_settings.get("worker", {}))),
        state_dir=args.state_dir,
        fsync=args.fsync,
        restart=RestartPolicy(max_restarts_per_minute=args.max_restarts_per_minute),
    )


def up_config(argv: Sequence[str]) -> StackConfig:
    """The StackConfig that ``pagedkv up ARGV`` runs, planned for this machine: what benchmarks and
    tools start so that their stack is the one a user starts (``up_config(["--model", FILE])`` is
    ``pagedkv up --model FILE``), with ports, logs or a tuned flag added as ``up`` flags."""
    return options_from_args(build_parser().parse_args(list(argv)))


def plan_report(stack_plan: Plan, machine: Machine, verbose: bool) -> str:
    """The plan as ``up`` prints it: the machine, a line per role, then (``verbose``) why."""
    lines = [f"pagedkv up: plan for {machine.describe()}"]
    lines += [f"  {line}" for line in stack_plan.lines()]
    if verbose:
        lines += [f"  because: {r}" for r in stack_plan.reasons]
    lines += [f"  warning: {w}" for w in stack_plan.warnings]
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    machine = this_machine()
    stack_plan = plan_from_args(args, machine)
    if args.print_plan:
        print(plan_report(stack_plan, machine, verbose=True), flush=True)
        return 0
    opts = options_from_args(args, stack_plan)
    for warning in stack_plan.warnings:
        print(f"pagedkv up: warning: {warning}", file=sys.stderr, flush=True)
    configure_logging("info", opts.log_format)
    try:
        stack = Stack(opts)
    except StackSecurityError as e:
        print(f"pagedkv up: {e}", file=sys.stderr)
        return 2
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(
        f"pagedkv up: starting {len(stack.services)} services; block manager state in {stack.state_dir} "
        + (
            "(temporary: removed at stop; --state-dir DIR keeps it)"
            if stack.state_dir_is_temporary
            else "(kept)"
        ),
        flush=True,
    )
    try:
        stack.start()
    except (RuntimeError, TimeoutError) as e:
        print(f"pagedkv up: {e}", file=sys.stderr)
        return 1
    bm = stack.services[0].address
    workers = ",".join(s.address for s in stack.services if s.name.startswith("worker-"))
    secure = stack.security.client_flags()
    frontend = next((s for s in stack.services if s.name == "frontend"), None)
    direct = (
        f"pagedkv generate --block-manager {bm} --workers {workers} --token-ids 1,2,3 --max-tokens 16"
        f"{' ' + secure if secure else ''}"
    )
    if frontend is not None:
        url = frontend.health_url.removesuffix("/health")
        tls = stack.security.client_tls()
        tls_flags = (
            f" --tls-ca {tls['tls_ca']} --tls-cert {tls['tls_cert']} --tls-key {tls['tls_key']}"
            if tls
            else ""
        )
        print(plan_report(stack_plan, machine, verbose=True), flush=True)
        print(
            f"pagedkv up: ready. Try:  pagedkv generate --url {url} --token-ids 1,2,3 --max-tokens "
            f"16{tls_flags}\n"
            f'            OpenAI-compatible API at {url}/v1 (e.g. the openai SDK with base_url="{url}/v1")\n'
            f"            The engine in the command itself:  {direct}\n"
            f"            Ctrl-C stops everything.",
            flush=True,
        )
    else:
        print(plan_report(stack_plan, machine, verbose=True), flush=True)
        print(f"pagedkv up: ready. Try:  {direct}\n            Ctrl-C stops everything.", flush=True)
    ready_file = pathlib.Path(args.ready_file) if args.ready_file else None
    if ready_file is not None:
        stack.ready().write(ready_file)
    try:
        code = supervise(stack, stop, opts.restart)
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
    print("pagedkv up: stopping", flush=True)
    leaked = stack.stop()
    if leaked:
        print(f"pagedkv up: shared memory left in /dev/shm: {leaked}", file=sys.stderr)
        return 1
    print("pagedkv up: stopped; nothing left running, no shared memory left behind", flush=True)
    return code
