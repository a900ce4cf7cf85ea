"""The frontend talks to the services over gRPC only.

No frontend module imports torch or a worker module at import time, and no frontend module names
a service's internals (``pagedkv.block_manager_svc``, ``pagedkv.worker_svc``) at all, except the
in-process launcher, which runs the services in its own process.

Each frontend module is imported in a fresh interpreter where a meta-path finder refuses ``torch``
and ``pagedkv.worker_svc`` (and everything under them), so an import at module level anywhere in the
module's import graph fails the test. ``frontend/launch/local_stack.py`` runs workers in-process and
imports them inside ``LocalStack.__init__``: importing it is covered here like any other module.
"""

from __future__ import annotations

import ast
import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(("pagedkv", *p.relative_to(ROOT).with_suffix("").parts)).removesuffix(".__init__")
    for p in (ROOT / "frontend").rglob("*.py")
    if p.relative_to(ROOT).parts[1:] != ("__init__.py",)
)
WORKER = "pagedkv.worker_svc"
BLOCKED = ("torch", WORKER)

# Worker modules the frontend may still import, each with its reason: none (the cache-host-loss
# signal is a structured error detail, pagedkv/errors.py, not a worker module's message prefix).
ALLOWED: tuple[str, ...] = ()

GUARD = f"""
import importlib, importlib.abc, sys
BLOCKED, ALLOWED, WORKER = {BLOCKED!r}, {ALLOWED!r}, {WORKER!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ALLOWED or name == WORKER:
            return None
        if any(name == b or name.startswith(b + ".") for b in BLOCKED):
            raise ImportError("blocked for this test: " + name)
        return None
sys.meta_path.insert(0, Refuse())
failed = []
for m in sys.argv[1:]:
    try:
        importlib.import_module(m)
    except Exception as e:
        failed.append(f"{{m}}: {{type(e).__name__}}: {{e}}")
leaked = sorted(n for n in sys.modules if n == "torch" or n.startswith("torch.") or
                (n.startswith(WORKER + ".") and n not in ALLOWED))
print("\\n".join(failed + ["loaded: " + n for n in leaked]))
sys.exit(1 if failed or leaked else 0)
"""


def test_every_frontend_module_imports_without_torch_or_worker_modules() -> None:
    assert {
        "pagedkv.frontend.engine",
        "pagedkv.frontend.engine.scheduler",
        "pagedkv.frontend.engine.policy",
        "pagedkv.frontend.launch.local_stack",
    } <= set(MODULES)
    res = subprocess.run(
        [sys.executable, "-c", GUARD, *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_guard_catches_a_torch_import() -> None:
    """The same guard fails a module that does import torch (the test above can fail)."""
    res = subprocess.run(
        [sys.executable, "-c", GUARD, "pagedkv.worker_svc.model.sampling"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "blocked for this test" in res.stdout


SERVICES = ("pagedkv.block_manager_svc", "pagedkv.worker_svc")
# The one frontend module that may import service code: it starts the services in-process.
LAUNCHER = "frontend/launch/local_stack.py"
# Other (module, service module) pairs, each with its reason.
SERVICE_IMPORTS_ALLOWED = {
    # `pagedkv up --kv-cache-memory`: the block manager divides the budget by the cache's bytes per block,
    # which the model's dimensions and the KV dtype give, computed as the cache host checks them
    # (imported inside the function, only when a budget is given).
    ("frontend/launch/processes.py", "pagedkv.worker_svc.geometry"),
}


def service_imports(path: pathlib.Path) -> set[str]:
    """The service modules ``path`` imports, anywhere in it (also inside functions)."""
    names: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            names.update(a.name for a in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.update(f"{node.module}.{a.name}" for a in node.names)
    return {n for n in names if any(n == s or n.startswith(s + ".") for s in SERVICES)}


def _owner(name: str) -> str:
    """``pagedkv.worker_svc.model.model_source`` for ``from pagedkv.worker_svc.model import
    model_source``, and the module itself for ``from pagedkv.worker_svc.model.model_source import x``."""
    parts = name.split(".")
    while parts and not (ROOT.joinpath(*parts).with_suffix(".py").exists() or ROOT.joinpath(*parts).is_dir()):
        parts.pop()
    return ".".join(parts)


def test_only_the_in_process_launcher_imports_service_internals() -> None:
    found = {
        (str(p.relative_to(ROOT)), _owner(n))
        for p in (ROOT / "frontend").rglob("*.py")
        if str(p.relative_to(ROOT)) != LAUNCHER
        for n in service_imports(p)
    }
    assert found == SERVICE_IMPORTS_ALLOWED
    assert service_imports(ROOT / LAUNCHER), "the launcher should be what starts the services"


def test_the_service_scan_sees_imports_inside_functions(tmp_path: pathlib.Path) -> None:
    path = tmp_path / "m.py"
    path.write_text(
        "def f():\n"
        "    from pagedkv.block_manager_svc.core import manager\n"
        "    import pagedkv.worker_svc.server\n"
    )
    assert {_owner(n) for n in service_imports(path)} == {
        "pagedkv.block_manager_svc.core.manager",
        "pagedkv.worker_svc.server",
    }


def test_the_engine_module_only_plans_calls_and_applies() -> None:
    """engine.py keeps the I/O only (plan, call, apply); queues and transitions are scheduler.py's,
    what the block manager holds is remote_table.py's. A module past this size has taken on a
    decision that belongs in one of them."""
    lines = (ROOT / "frontend" / "engine" / "engine.py").read_text().count("\n")
    assert lines < 450, f"frontend/engine/engine.py has {lines} lines: move a decision out of it"
