"""Which settings class each section of a settings file (and each command) has.

Named by module path and imported on demand: ``pagedkv up`` reads a ``[worker]`` section with the
worker's own settings class without importing any service module when the file has none (the
frontend imports no service module at import time, tests/frontend/test_layering.py), and the
settings classes themselves import neither torch nor a service's internals.
"""

from __future__ import annotations

import importlib

from pydantic_settings import BaseSettings

from pagedkv.settings_file import SECTIONS

# section -> "module:class"; the order docs/settings.md lists them in.
CLASSES: dict[str, str] = {
    "up": "pagedkv.frontend.launch.up_settings:UpSettings",
    "serve": "pagedkv.frontend.serve.settings:ServeSettings",
    "block-manager": "pagedkv.block_manager_svc.settings:BlockManagerSettings",
    "cache-host": "pagedkv.worker_svc.settings:CacheHostSettings",
    "worker": "pagedkv.worker_svc.settings:WorkerSettings",
}
assert tuple(CLASSES) == SECTIONS


def settings_class(section: str) -> type[BaseSettings]:
    module, name = CLASSES[section].split(":")
    cls = getattr(importlib.import_module(module), name)
    assert issubclass(cls, BaseSettings)
    return cls
