"""The whole stack inside one process, on ephemeral loopback ports.

Used by `pagedkv generate --local`, `pagedkv demo --local` and the tests: a
block manager, a cache host and N workers as real gRPC servers, so the engine
drives exactly the same RPCs as against separate processes. Everything binds
to 127.0.0.1 and `close()` stops the servers and unlinks the shared memory.

The workers compute on the cache object the stack created (``start_worker(local_cache=...)``), not on
a mapping of the descriptor the cache host serves: a process cannot open its own CUDA IPC handle, so
attaching would fail on every GPU host (``--device auto`` picks CUDA there).

It is the one frontend module that runs workers: the worker modules (and torch) are imported inside
`LocalStack.__init__`, so importing it, like importing any other frontend module, loads neither.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pagedkv.block_manager_svc.server import BlockManagerServer
from pagedkv.block_manager_svc.server import start_server as start_block_manager
from pagedkv.block_manager_svc.settings import BlockManagerSettings
from pagedkv.frontend.clients.block_manager import BlockManagerClient
from pagedkv.frontend.clients.worker import StepTransport, WorkerClient
from pagedkv.frontend.engine import Engine, EngineConfig
from pagedkv.frontend.launch.config import StackConfig, worker_roles

__all__ = ["LocalStack"]

if TYPE_CHECKING:
    from pagedkv.grpc_server import GrpcServer
    from pagedkv.worker_svc.server import WorkerProcess


class LocalStack:
    """Block manager + cache host + workers in this process. Use as a context manager.

    Of ``StackConfig`` it uses the stack's own fields; the processes-only ones (ports, logs,
    security, restarts) do not apply: every server binds an ephemeral loopback port."""

    def __init__(self, config: StackConfig | None = None) -> None:
        # The in-process workers: imported here, not at module level (see the module docstring).
        from pagedkv.block_manager_svc.core.kv_groups import parse_kv_groups
        from pagedkv.worker_svc.cache import memory as cache_memory
        from pagedkv.worker_svc.cache.host import serve_cache
        from pagedkv.worker_svc.cache.layout import CacheGeometry
        from pagedkv.worker_svc.devices import resolve_device, resolve_dtype
        from pagedkv.worker_svc.geometry import draft_config, draft_geometry, kv_groups_for, model_block_bytes
        from pagedkv.worker_svc.model.config import load_model_config
        from pagedkv.worker_svc.model.kv_layout import kv_layout
        from pagedkv.worker_svc.server import start_worker
        from pagedkv.worker_svc.settings import WorkerSettings

        self.config = cfg = config or StackConfig()
        self._closers: list[object] = []
        try:
            kv_groups = str(
                cfg.block_manager_overrides.get("kv_groups", kv_groups_for(cfg.model, cfg.kv_groups))
            )
            pool: dict[str, object] = {"num_gpu_blocks": cfg.num_gpu_blocks, "kv_groups": kv_groups}
            if cfg.kv_cache_memory:  # the pool from a budget over this model's bytes per block
                pool = {
                    "kv_cache_memory": cfg.kv_cache_memory,
                    "kv_bytes_per_block": model_block_bytes(
                        cfg.model,
                        cfg.dtype,
                        cfg.device,
                        cfg.block_size,
                        cfg.kv_cache_dtype,
                        kv_groups,
                        cfg.speculative_model,
                    ),
                    "kv_groups": kv_groups,
                }
            bm_settings = BlockManagerSettings(
                port=0,
                block_size=cfg.block_size,
                num_cpu_blocks=cfg.num_cpu_blocks,
                kv_cache_dtype=cfg.kv_cache_dtype,
                **pool,  # type: ignore[arg-type]
                **{k: v for k, v in cfg.block_manager_overrides.items() if k != "kv_groups"},  # type: ignore[arg-type]
            )
            num_gpu_blocks = bm_settings.num_gpu_blocks
            self.block_manager: BlockManagerServer = start_block_manager(bm_settings)
            self._closers.append(lambda: self.block_manager.stop(0))
            device = resolve_device(cfg.device)
            dtype = resolve_dtype(cfg.dtype, device)
            model_cfg = load_model_config(cfg.model)
            draft = draft_config(cfg.speculative_model, model_cfg)
            geometry = CacheGeometry(
                kv_layout(model_cfg, parse_kv_groups(kv_groups)).layers_per_block,
                model_cfg.num_kv_heads,
                model_cfg.head_dim,
                cfg.block_size,
                num_gpu_blocks,
                cfg.num_cpu_blocks,
                cfg.kv_cache_dtype,
                **draft_geometry(draft),
            )
            self.cache = cache_memory.create(
                geometry, dtype, device, "pagedkv-local", draft_model=draft.name if draft is not None else ""
            )
            self._closers.append(self.cache.close)
            self.cache_host: GrpcServer = serve_cache(self.cache, model_cfg.name)
            self._closers.append(lambda: self.cache_host.stop(0))
            self.workers: list[WorkerProcess] = []
            roles = worker_roles(cfg.roles, cfg.num_workers)  # ValueError on a bad list
            for i in range(cfg.num_workers):
                proc = start_worker(
                    WorkerSettings(
                        port=0,
                        cache_host=f"127.0.0.1:{self.cache_host.port}",
                        block_manager=f"127.0.0.1:{self.block_manager.port}",
                        model=cfg.model,
                        device=str(device),
                        dtype=cfg.dtype,
                        weight_format=cfg.weight_format,
                        kernel_backend=cfg.kernel_backend,
                        seed=cfg.seed,
                        speculative_model=cfg.speculative_model,
                        role=roles[i],
                        block_size=cfg.block_size,
                        num_gpu_blocks=num_gpu_blocks,
                        num_cpu_blocks=cfg.num_cpu_blocks,
                        kv_cache_dtype=cfg.kv_cache_dtype,
                    ),
                    local_cache=self.cache,  # this process exported it: no IPC round trip (CUDA forbids it)
                )
                self.workers.append(proc)
                self._closers.append(proc.close)
        except BaseException:
            self.close()
            raise

    @property
    def block_manager_target(self) -> str:
        return f"127.0.0.1:{self.block_manager.port}"

    @property
    def worker_targets(self) -> list[str]:
        return [f"127.0.0.1:{w.running.port}" for w in self.workers]

    def engine(self, config: EngineConfig | None = None, step_transport: StepTransport = "auto") -> Engine:
        """An engine with its own clients on this stack (closed with the stack); ``step_transport``
        as WorkerClient's (the workers run in this process: ``auto`` takes the step channel)."""
        bm = BlockManagerClient(self.block_manager_target)
        workers = [WorkerClient(t, step_transport=step_transport) for t in self.worker_targets]
        self._closers.append(bm.close)
        self._closers.extend(w.close for w in workers)
        engine = Engine(bm, workers, config)
        self._closers.append(engine.close)
        return engine

    def close(self) -> None:
        while self._closers:
            closer = self._closers.pop()
            try:
                closer()  # type: ignore[operator]
            except Exception:  # noqa: BLE001 - keep closing the rest
                pass

    def __enter__(self) -> LocalStack:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
