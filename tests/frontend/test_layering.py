"""The frontend talks to workers over gRPC only: no frontend module imports torch or a worker module.

Each frontend module is imported in a fresh interpreter where a meta-path finder refuses ``torch``
and ``worker_svc`` (and everything under them), so an import at module level anywhere in the
module's import graph fails the test. ``frontend/local_stack.py`` runs workers in-process and
imports them inside ``LocalStack.__init__``: importing it is covered here like any other module.
"""

from __future__ import annotations

import pathlib
import subprocess
import sys

ROOT = pathlib.Path(__file__).resolve().parents[2]
MODULES = sorted(
    ".".join(p.relative_to(ROOT).with_suffix("").parts).removesuffix(".__init__")
    for p in (ROOT / "frontend").rglob("*.py")
    if p.relative_to(ROOT).parts[1:] != ("__init__.py",)
)
BLOCKED = ("torch", "worker_svc")

# Worker modules the frontend may still import, each with its reason: none (the cache-host-loss
# signal is a structured error detail, pagedkv/errors.py, not a worker module's message prefix).
ALLOWED: tuple[str, ...] = ()

GUARD = f"""
import importlib, importlib.abc, sys
BLOCKED, ALLOWED = {BLOCKED!r}, {ALLOWED!r}
class Refuse(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path=None, target=None):
        if name in ALLOWED or name == "worker_svc":
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
                (n.startswith("worker_svc.") and n not in ALLOWED))
print("\\n".join(failed + ["loaded: " + n for n in leaked]))
sys.exit(1 if failed or leaked else 0)
"""


def test_every_frontend_module_imports_without_torch_or_worker_modules() -> None:
    assert {
        "frontend.engine",
        "frontend.engine.scheduler",
        "frontend.engine.policy",
        "frontend.local_stack",
    } <= set(MODULES)
    res = subprocess.run(
        [sys.executable, "-c", GUARD, *MODULES], cwd=ROOT, capture_output=True, text=True, timeout=120
    )
    assert res.returncode == 0, res.stdout + res.stderr


def test_the_guard_catches_a_torch_import() -> None:
    """The same guard fails a module that does import torch (the test above can fail)."""
    res = subprocess.run(
        [sys.executable, "-c", GUARD, "worker_svc.model.sampling"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert res.returncode == 1 and "blocked for this test" in res.stdout
