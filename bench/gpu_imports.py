"""Every import bench/gpu_check.sh's sections need, checked in the interpreter they will run in.

    python -s bench/gpu_imports.py [--gpu]     # exit 1 naming every module that does not import

Why: the GPU image lacks the services' dependencies (structlog, pydantic, ...) and they come from
an offline wheelhouse (tools/gpu_wheels.sh). gpu_check.sh runs this in a clean interpreter (no user
site, PYTHONPATH = the checkout + the installed wheelhouse only) right after installing it, so that
a missing or incomplete wheelhouse fails the wheels section instead of the worker and pd sections
minutes later. It also prints which protobuf and grpc the sections really import (version and file):
the generated code in pagedkv/v1 refuses a protobuf runtime older than the one it was made with.
``--gpu`` also requires the GPU-only ones (cupy).
"""

from __future__ import annotations

import importlib
import sys
import traceback

# module -> what needs it (the section(s))
NEEDED = {
    "torch": "every section",
    "triton": "pytest, bench, worker, graphs, pd",
    "numpy": "pytest, bench",
    "pytest": "pytest, ipc",
    "safetensors": "worker, pd (checkpoints)",
    "google.protobuf": "worker, pd (gRPC messages)",
    "grpc": "worker, pd",
    "grpc_health.v1.health_pb2": "worker, pd (health service)",
    "grpc_reflection.v1alpha.reflection": "worker, pd (reflection)",
    "structlog": "pytest (CUDA graphs test), worker, graphs, pd (logging)",
    "pydantic": "worker, pd (settings)",
    "pydantic_settings": "worker, pd (settings)",
    "prometheus_client": "worker, pd (metrics)",
    "msgspec": "pd (block manager)",
    "zmq": "pd (block manager KV events)",
    # the project's own modules: the protobuf runtime check and every service import chain
    "pagedkv.v1.worker_pb2": "worker, pd (protobuf runtime check)",
    "kernels": "pytest, bench",
    "worker_svc.server": "worker, pd",
    "worker_svc.model.cuda_graphs": "pytest (CUDA graphs test), graphs",
    "worker_svc.model_runner": "pytest (CUDA graphs test), worker, graphs",
    "block_manager_svc.core": "pytest (CUDA graphs test: block tables)",
    "block_manager_svc.server": "pd",
    "frontend.launch.processes": "pd",
    "frontend.engine": "pd",
}
GPU_ONLY = {"cupy": "ipc, worker, pd (CUDA IPC)"}


def main(argv: list[str]) -> int:
    needed = dict(NEEDED, **(GPU_ONLY if "--gpu" in argv else {}))
    missing: list[str] = []
    for name, why in needed.items():
        try:
            importlib.import_module(name)
        except Exception as e:  # noqa: BLE001 - report every failure, not the first
            missing.append(name)
            print(f"MISSING {name} (needed by {why}): {type(e).__name__}: {e}")
            if not isinstance(e, ImportError):
                traceback.print_exc(limit=3)
    for name in ("google.protobuf", "grpc"):
        mod = sys.modules.get(name)
        if mod is not None:
            print(f"{name} {getattr(mod, '__version__', '?')} from {getattr(mod, '__file__', '?')}")
    if missing:
        print(f"{len(missing)} of {len(needed)} imports failed: {', '.join(missing)}")
        return 1
    print(f"all {len(needed)} imports ok (python {sys.version.split()[0]} at {sys.executable})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
