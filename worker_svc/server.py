"""Process wiring for the two roles: settings -> cache / model -> gRPC server -> signals -> cleanup.

``run_cache_host`` allocates and exports the cache and serves its descriptor until SIGTERM/SIGINT.
``run_worker`` waits for the block manager and the cache host (worker_svc/peers.py: a log line per
attempt, dialled with the role's TLS client credentials and token), checks the geometry
against everything it knows, attaches, loads the model and serves the Worker API; on shutdown it
stops serving, drops its views and closes its handles. Both return an exit code: 0 after a clean
shutdown, 2 for a configuration error (geometry mismatch, bad model dir), 1 when serving failed,
3 after its cache host was lost (died or replaced; see worker_svc/cache_watch.py) and no new one
could be attached within ``--cache-lost-exit-after-s`` (a new instance at the same address is
re-attached in place: worker_svc/reattach.py).
"""

from __future__ import annotations

import os
import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, TypedDict, cast

import structlog
import torch
from grpc_health.v1 import health_pb2

from pagedkv.block_manager_svc.core.kv_groups import ONE_GROUP, KVGroup
from pagedkv.dial import Dialer, TokenError
from pagedkv.grpc_server import GrpcServer, start_server, stop_event_on_signals
from pagedkv.logging_setup import configure_logging
from pagedkv.v1 import cache_host_pb2, worker_pb2, worker_pb2_grpc
from pagedkv.worker_svc import cpu_placement, heap
from pagedkv.worker_svc.cache import memory as cache_memory
from pagedkv.worker_svc.cache import shared_weights
from pagedkv.worker_svc.cache.host import (
    CacheOwner,
    descriptor_from_proto,
    geometry_to_proto,
    serve_cache,
    weights_from_proto,
)
from pagedkv.worker_svc.cache.layout import GeometryMismatch, dtype_from_name, dtype_name
from pagedkv.worker_svc.cache.shared_weights import SharedWeights, WeightsDescriptor
from pagedkv.worker_svc.cache_watch import EXIT_CACHE_LOST, CacheHostWatcher
from pagedkv.worker_svc.devices import resolve_device, resolve_dtype
from pagedkv.worker_svc.geometry import (
    PoolConfig,
    check_against_host,
    check_block_bytes,
    draft_config,
    host_geometry,
    known_values,
)
from pagedkv.worker_svc.model.config import ModelConfig, load_model_config
from pagedkv.worker_svc.peers import (
    StopRequested,
    forget_stale_prefixes,
    wait_for_block_manager,
    wait_for_cache_host,
)
from pagedkv.worker_svc.reattach import reattach
from pagedkv.worker_svc.servicer import SERVICE_NAME as WORKER_SERVICE
from pagedkv.worker_svc.servicer import WorkerServicer
from pagedkv.worker_svc.settings import CacheHostSettings, WorkerSettings
from pagedkv.worker_svc.step_channel import StepChannelServer

if TYPE_CHECKING:
    from pagedkv.worker_svc.model.registry import Model
    from pagedkv.worker_svc.model_runner import ModelRunner

# --role -> WorkerInfo.role
ROLES = {
    "mixed": worker_pb2.WORKER_ROLE_MIXED,
    "prefill": worker_pb2.WORKER_ROLE_PREFILL,
    "decode": worker_pb2.WORKER_ROLE_DECODE,
}

log = structlog.get_logger("pagedkv.worker_svc")

EXIT_OK, EXIT_FAILED, EXIT_CONFIG = 0, 1, 2  # and EXIT_CACHE_LOST = 3 (cache_watch.py)
# What a role's start-up raises for bad configuration or unreachable peers: EXIT_CONFIG, one log line.
CONFIG_ERRORS = (GeometryMismatch, ValueError, FileNotFoundError, ConnectionError, TimeoutError, TokenError)


def _pool(
    settings: CacheHostSettings | WorkerSettings,
    timeout_s: float,
    dialer: Dialer,
    stop: threading.Event | None = None,
) -> PoolConfig | None:
    """The block manager's geometry, waited for (a log line per attempt; the error names the address)."""
    if not settings.block_manager:
        return None
    log.info("reading_geometry_from_block_manager", block_manager=settings.block_manager)
    return wait_for_block_manager(settings.block_manager, timeout_s, stop, dialer)


def _start_refused(e: BaseException) -> int:
    """A role that did not start: stopped by a signal while waiting (EXIT_OK) or misconfigured."""
    if isinstance(e, StopRequested):
        log.info("stopped_before_ready")
        return EXIT_OK
    log.error("config_error", error=str(e))
    return EXIT_CONFIG


def run_cache_host(settings: CacheHostSettings) -> int:
    configure_logging(settings.log_level, settings.log_format)
    structlog.contextvars.bind_contextvars(role="cache-host", pid=os.getpid())
    try:
        device = resolve_device(settings.device)
        dtype = resolve_dtype(settings.dtype, device)
        model_cfg = load_model_config(settings.model)
        stop = stop_event_on_signals()
        pool = _pool(settings, settings.connect_timeout_s, Dialer.from_settings(settings), stop)
        geometry = host_geometry(settings, model_cfg, pool)
        check_block_bytes(pool, geometry, dtype, f"this cache host (model {model_cfg.name})")
    except (StopRequested, *CONFIG_ERRORS) as e:
        return _start_refused(e)
    draft = draft_config(settings.speculative_model, model_cfg)
    cache = cache_memory.create(
        geometry, dtype, device, settings.shm_prefix, draft_model=draft.name if draft is not None else ""
    )
    owner = CacheOwner(cache)
    if settings.block_manager:  # before serving: nothing can attach and run on the manager's stale prefixes
        forget_stale_prefixes(
            settings.block_manager, cache.descriptor.instance_id, 10.0, Dialer.from_settings(settings)
        )
    try:
        weights = _share_weights(settings, model_cfg, dtype, device)
        if weights is not None:
            owner.also_close(weights)
        running = serve_cache(
            cache,
            model_cfg.name,
            settings.host,
            settings.port,
            weights=weights.descriptor if weights is not None else None,
            **_tls(settings),
            auth_tokens_file=settings.auth_tokens_file,
        )
        desc = cache.descriptor
        log.info(
            "cache_host_ready",
            address=f"{settings.host}:{running.port}",
            port=running.port,
            backend=desc.backend,
            device=str(device),
            dtype=desc.dtype,
            instance_id=desc.instance_id,
            gpu_segment=desc.gpu.shm_name or None,
            cpu_segment=desc.cpu.shm_name,
            kv_bytes=geometry.num_gpu_blocks * geometry.block_bytes(dtype),
            swap_bytes=geometry.num_cpu_blocks * geometry.block_bytes(dtype),
            weights_bytes=weights.nbytes if weights is not None else 0,
            weight_format=settings.weight_format,
            weights_source=weights.descriptor.source if weights is not None else None,
            **geometry.as_dict(),
        )
        stop.wait()
        log.info("shutting_down")
        running.stop(grace=1.0)
    except (ValueError, FileNotFoundError) as e:
        log.error("config_error", error=str(e))
        return EXIT_CONFIG
    except RuntimeError as e:
        log.error("serve_failed", error=str(e))
        return EXIT_FAILED
    finally:
        owner.close()
    log.info("stopped")
    return EXIT_OK


def _share_weights(
    settings: CacheHostSettings, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> SharedWeights | None:
    """Load the weights once, fused as the model uses them, into one exported region (shared_weights.py)."""
    if not settings.share_weights:
        return None
    from pagedkv.worker_svc.model import weight_format
    from pagedkv.worker_svc.model.weights import fuse, load_checkpoint, weights_source

    held = weight_format.resolve(settings.weight_format, settings.model, device, dtype)
    tensors = fuse(load_checkpoint(settings.model, model_cfg, dtype, device, settings.seed, held), model_cfg)
    shared = shared_weights.pack(
        tensors, device, weights_source(settings.model, model_cfg, settings.seed, held), settings.shm_prefix
    )
    del tensors
    heap.release_free_memory()  # the loading temporaries (heap.py)
    if device.type == "cuda":
        # The loading copies, else kept by torch's caching allocator: one copy per device.
        torch.cuda.empty_cache()
    return shared


def _model_for_worker(
    settings: WorkerSettings,
    model_cfg: ModelConfig,
    dtype: torch.dtype,
    device: torch.device,
    host_weights: WeightsDescriptor | None,
) -> tuple[Model, SharedWeights | None]:
    """The cache host's shared weights when there are some (and --weights allows), else a private load.

    Two different models on one cache would mix their KV: a worker whose own settings name other
    weights than the host's refuses to start (GeometryMismatch: a configuration error)."""
    from pagedkv.worker_svc.model import weight_format
    from pagedkv.worker_svc.model.registry import build_model
    from pagedkv.worker_svc.model.weights import fused_spec, load_model, weights_source

    held = weight_format.resolve(settings.weight_format, settings.model, device, dtype)
    if settings.weights == "local" or (settings.weights == "auto" and host_weights is None):
        model = load_model(settings.model, model_cfg, dtype, device, seed=settings.seed, held=held)
        heap.release_free_memory()  # the loading temporaries (heap.py)
        return model, None
    if host_weights is None:
        raise GeometryMismatch(
            f"--weights shared, but the cache host at {settings.cache_host} exports no weights "
            "(start it with --share-weights)"
        )
    mine = weights_source(settings.model, model_cfg, settings.seed, held)
    if host_weights.source != mine:
        raise GeometryMismatch(
            f"weights mismatch: this worker would load {mine!r}, the cache host at {settings.cache_host} "
            f"shares {host_weights.source!r} (give both the same --model / --seed / --weight-format, "
            "or --weights local)"
        )
    shared = shared_weights.bind(host_weights, device, fused_spec(settings.model, model_cfg, dtype, held))
    return build_model(model_cfg, shared.tensors), shared


def _draft_for_worker(
    settings: WorkerSettings, model_cfg: ModelConfig, dtype: torch.dtype, device: torch.device
) -> Model | None:
    """Speculative decoding's draft model (``--speculative-model``), loaded privately by each worker
    (it is small beside the model): None without one."""
    draft_cfg = draft_config(settings.speculative_model, model_cfg)
    if draft_cfg is None:
        return None
    from pagedkv.worker_svc.model import weight_format
    from pagedkv.worker_svc.model.weights import load_model

    held = weight_format.resolve(settings.weight_format, settings.speculative_model, device, dtype)
    draft = load_model(settings.speculative_model, draft_cfg, dtype, device, seed=settings.seed, held=held)
    heap.release_free_memory()
    return draft


def _runner(
    settings: WorkerSettings,
    model: Model,
    cache: cache_memory.SharedCache,
    kv_groups: tuple[KVGroup, ...] = ONE_GROUP,
    draft: Model | None = None,
) -> ModelRunner:
    """A worker's model runner on ``cache``, with decode graphs of its own when they are on: a
    runner built for a re-attached cache captures them again (the old ones hold the old addresses)."""
    from pagedkv.worker_svc.model import cuda_graphs
    from pagedkv.worker_svc.model_runner import ModelRunner

    gpu = cache.gpu
    graphs = cuda_graphs.for_worker(
        settings.cuda_graphs,
        settings.cuda_graph_max_batch,
        settings.cuda_graph_max_context,
        gpu.device,
        block_size=int(gpu.shape[3]),
        num_gpu_blocks=int(gpu.shape[2]),
    )
    return ModelRunner(
        model,
        gpu,
        cache.cpu,
        kernel_backend=settings.kernel_backend,
        decode_graphs=graphs,
        kv_groups=kv_groups,
        draft=draft,
        draft_gpu_cache=cache.draft_gpu,
        draft_cpu_cache=cache.draft_cpu,
    )


@dataclass(slots=True)
class WorkerProcess:
    """A started worker: its server, runner and attached cache (used by the CLI and by tests)."""

    running: GrpcServer
    servicer: WorkerServicer
    cache: cache_memory.SharedCache
    weights: SharedWeights | None = None  # the cache host's shared weights, when mapped
    watcher: CacheHostWatcher | None = None
    step_channel: StepChannelServer | None = None  # the one-host step transport, when on
    lost_at: float | None = None  # monotonic time the cache host was declared lost (None: attached)
    reattach_failed: bool = False  # a new cache host answered but could not be attached: exit with code 3 now
    closed: bool = False
    # Held while re-attaching (worker_svc/reattach.py) and while closing: never both at once.
    attach_lock: threading.Lock = field(default_factory=threading.Lock)

    def close(self) -> None:
        if self.watcher is not None:
            self.watcher.stop()
        if self.step_channel is not None:
            self.step_channel.close()
        self.running.stop(grace=1.0)
        with self.attach_lock:
            self.closed = True
            self._release()

    def _release(self) -> None:
        runner = self.servicer.runner

        def release() -> None:  # the cache and the shared weights: the model's views of both go first
            self.cache.close()
            if self.weights is not None:
                self.weights.close()

        if runner is not None:  # waits for a step still running after the grace period, drops its views
            runner.close(release=release)
        release()  # idempotent


def start_worker(
    settings: WorkerSettings,
    stop: threading.Event | None = None,
    local_cache: cache_memory.SharedCache | None = None,
) -> WorkerProcess:
    """Everything up to SERVING. Raises GeometryMismatch / ValueError / TimeoutError on bad config.

    ``local_cache``: the cache host's own cache when the host runs in this process (``LocalStack``).
    The worker then uses that object (``cache_memory.borrow``) instead of mapping the descriptor the
    host serves: CUDA refuses to open a process's own IPC handle. Everything else (geometry checks,
    the cache host watcher) still goes through the host's gRPC API, as for a worker in its own process."""
    cpus, threads = cpu_placement.apply(settings.cpu_affinity, settings.num_threads)
    device = resolve_device(settings.device)
    model_cfg = load_model_config(settings.model)
    dialer = Dialer.from_settings(settings)
    pool = _pool(settings, settings.connect_timeout_s, dialer, stop)
    known = known_values(settings, model_cfg, pool)
    info = wait_for_cache_host(settings.cache_host, settings.connect_timeout_s, stop, dialer)
    desc = descriptor_from_proto(info)
    check_against_host(known, desc.geometry, f"the cache host at {settings.cache_host}")
    if settings.dtype != "auto" and settings.dtype != desc.dtype:
        raise GeometryMismatch(
            f"cache dtype mismatch: settings have {settings.dtype}, the cache host has {desc.dtype}"
        )
    dtype = dtype_from_name(desc.dtype)
    check_block_bytes(pool, desc.geometry, dtype, f"the cache host at {settings.cache_host}")
    if local_cache is not None:
        cache = cache_memory.borrow(local_cache, desc, device)
    else:
        cache = cache_memory.attach(desc, device)
    weights: SharedWeights | None = None
    channel: StepChannelServer | None = None
    try:
        model, weights = _model_for_worker(settings, model_cfg, dtype, device, weights_from_proto(info))
        draft = _draft_for_worker(settings, model_cfg, dtype, device)
        runner = _runner(settings, model, cache, pool.kv_groups if pool is not None else ONE_GROUP, draft)
        from pagedkv import kernels
        from pagedkv.kernels.cpu import native as cpu_native

        winfo = worker_pb2.WorkerInfo(
            model_name=model_cfg.name,
            vocab_size=model_cfg.vocab_size,
            num_layers=model_cfg.num_layers,
            num_heads=model_cfg.num_heads,
            num_kv_heads=model_cfg.num_kv_heads,
            head_dim=model_cfg.head_dim,
            hidden_size=model_cfg.hidden_size,
            dtype=dtype_name(dtype),
            device=str(device),
            geometry=geometry_to_proto(desc.geometry),
            cache_instance_id=desc.instance_id,
            kernel_backend=kernels.backend_for(cache.gpu, settings.kernel_backend),
            role=ROLES[settings.role],
            shared_weights=weights is not None,
            cpu_kernel_path=cpu_native.kernel_path() if device.type == "cpu" else "",
            cuda_graph_sizes=runner.decode_graphs.sizes if runner.decode_graphs is not None else (),
            weight_bytes=model.weight_bytes,
            weight_format=settings.weight_format,
            linear_path=model.linear_path,
            draft_model_name=draft.cfg.name if draft is not None else "",
        )
        servicer = WorkerServicer(runner, winfo)
        if settings.step_channel and settings.auth_tokens_file:
            # The channel checks the peer's uid, not a bearer token: a worker that requires tokens
            # takes steps over gRPC only (docs/worker.md, "Step transport").
            log.info("step_channel_off", reason="--auth-tokens-file: steps must carry a token")
        elif settings.step_channel:
            try:
                channel = StepChannelServer(servicer.run_step)
                winfo.step_channel = channel.path
            except OSError as e:  # no usable directory: clients use gRPC, as with --no-step-channel
                log.warning("step_channel_unavailable", error=str(e))
        running = start_server(
            settings.host,
            settings.port,
            lambda s: worker_pb2_grpc.add_WorkerServicer_to_server(servicer, s),
            WORKER_SERVICE,
            max_workers=settings.max_workers,
            thread_prefix="worker-rpc",
            auth_tokens_file=settings.auth_tokens_file,
            **_tls(settings),
        )
    except BaseException:
        if channel is not None:
            channel.close()
        cache.close()
        if weights is not None:
            weights.close()
        raise
    proc = WorkerProcess(
        running=running, servicer=servicer, cache=cache, weights=weights, step_channel=channel
    )
    _watch_cache_host(proc, settings, desc.instance_id, dialer, device, model_cfg)
    log.info(
        "worker_ready",
        address=f"{settings.host}:{running.port}",
        port=running.port,
        cache_host=settings.cache_host,
        cache_instance_id=desc.instance_id,
        backend=desc.backend,
        cache_mapping="borrowed" if local_cache is not None else "attached",
        device=str(device),
        dtype=desc.dtype,
        model=model_cfg.name,
        draft_model=winfo.draft_model_name or None,
        kernel_backend=winfo.kernel_backend,
        cpu_kernel_path=winfo.cpu_kernel_path,
        linear_path=winfo.linear_path,
        weight_format=settings.weight_format,
        weight_bytes=winfo.weight_bytes,
        role=settings.role,
        step_channel=winfo.step_channel,
        shared_weights=weights is not None,
        cuda_graph_sizes=list(winfo.cuda_graph_sizes),
        cpus=cpus,
        threads=threads,
        **desc.geometry.as_dict(),
    )
    return proc


def _watch_cache_host(
    proc: WorkerProcess,
    settings: WorkerSettings,
    instance_id: str,
    dialer: Dialer,
    device: torch.device,
    model_cfg: ModelConfig,
) -> None:
    """Start the cache host watcher (cache_watch.py); a lost host turns the Worker service's health
    NOT_SERVING, a new instance at the same address is re-attached (reattach.py) and it turns
    SERVING again. The overall health ("") stays SERVING: the process is alive and recovering, so a
    liveness probe (Kubernetes checks "") must not kill it, while readiness (pagedkv.v1.Worker) stops
    routing to it."""
    if settings.cache_host_check_interval_s <= 0:
        return
    health = proc.running.health

    def set_health(status: int) -> None:
        health.set(WORKER_SERVICE, status)

    proc.servicer.on_cache_lost = lambda: set_health(health_pb2.HealthCheckResponse.NOT_SERVING)

    def on_replaced(info: cache_host_pb2.CacheInfo) -> bool:
        try:
            reattach(
                proc,
                info,
                device,
                model_for=lambda dtype, host_weights: _model_for_worker(
                    settings, model_cfg, dtype, device, host_weights
                ),
                runner_for=lambda model, cache: _runner(  # new graphs too
                    settings, model, cache, proc.servicer.runner.layout.groups, proc.servicer.runner.draft
                ),
                lock=proc.attach_lock,
            )
        except Exception as e:  # noqa: BLE001 - e.g. another geometry, or its memory not visible here
            log.error(
                "cache_host_reattach_failed",
                cache_host=settings.cache_host,
                new_instance_id=info.instance_id,
                error=f"{type(e).__name__}: {e}",
                exit_code=EXIT_CACHE_LOST,
                hint="a restarted worker attaches afresh (and reports a real mismatch at start-up)",
            )
            proc.reattach_failed = True
            return False
        proc.lost_at = None
        set_health(health_pb2.HealthCheckResponse.SERVING)
        return True

    def on_resumed() -> None:
        proc.servicer.resume_cache()
        proc.lost_at = None
        set_health(health_pb2.HealthCheckResponse.SERVING)

    def on_lost(reason: str, new_instance_id: str) -> None:
        if proc.servicer.mark_cache_lost(reason):
            proc.lost_at = time.monotonic()
            exit_in = settings.cache_lost_exit_after_s
            log.error(
                "cache_host_lost",
                cache_host=settings.cache_host,
                reason=reason,
                instance_id=instance_id,
                new_instance_id=new_instance_id or None,
                exit_code=EXIT_CACHE_LOST if exit_in > 0 else None,
                exit_in_s=exit_in if exit_in > 0 else None,
                action="KV must be re-prefilled after re-attaching to a new cache host",
            )

    proc.watcher = CacheHostWatcher(
        settings.cache_host,
        instance_id,
        settings.cache_host_check_interval_s,
        settings.cache_host_failures,
        on_lost,
        dialer,
        on_replaced=on_replaced if settings.cache_host_reattach else None,
        on_resumed=on_resumed,
    ).start()


def run_worker(settings: WorkerSettings) -> int:
    configure_logging(settings.log_level, settings.log_format)
    structlog.contextvars.bind_contextvars(role="worker", pid=os.getpid())
    stop = stop_event_on_signals()
    try:
        proc = start_worker(settings, stop)
    except (StopRequested, *CONFIG_ERRORS) as e:
        return _start_refused(e)
    except Exception as e:  # noqa: BLE001 - a start-up failure is an exit code and a log line
        log.error("start_failed", error=f"{type(e).__name__}: {e}", exc_info=True)
        return EXIT_FAILED
    code = EXIT_OK
    grace = settings.cache_lost_exit_after_s
    try:
        while not stop.wait(0.2):
            if proc.reattach_failed or (
                proc.lost_at is not None and grace > 0 and time.monotonic() - proc.lost_at >= grace
            ):
                log.error(
                    "exiting_after_cache_host_lost",
                    exit_code=EXIT_CACHE_LOST,
                    grace_s=grace,
                    hint="no new cache host was attached in time: restart this worker once one runs",
                )
                code = EXIT_CACHE_LOST
                break
        log.info("shutting_down")
    finally:
        proc.close()
    log.info("stopped")
    return code


class _TlsArgs(TypedDict):
    tls_cert: str
    tls_key: str
    tls_client_ca: str
    allow_insecure: bool


def _tls(settings: object) -> _TlsArgs:
    """The TLS keyword arguments of pagedkv.grpc_server.start_server from a role's settings."""
    return cast(
        _TlsArgs,
        {k: getattr(settings, k) for k in ("tls_cert", "tls_key", "tls_client_ca", "allow_insecure")},
    )
