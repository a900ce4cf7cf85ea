"""pytest plugin for gpu_check.sh's CPU rehearsal of the pytest section: each test function once.

    python -m pytest -p bench.gpu.one_case tests/kernels ...

Why: the pytest section's selection runs for real in the rehearsal (imports, conftest, fixtures,
the tests that start subprocesses or build native code: what the image can break), but its
parametrized numerics run in Triton's interpreter on CPU, where the whole selection takes minutes
on two cores; the GPU compiles them instead. Keeping the first case of every test function runs
every module and every test body once, with no list to keep by hand; the rest are deselected
(pytest reports how many).
"""

from __future__ import annotations

import pytest


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    seen: set[tuple[str, str]] = set()
    keep: list[pytest.Item] = []
    drop: list[pytest.Item] = []
    for item in items:
        key = (item.nodeid.split("::")[0], getattr(item, "originalname", item.name))
        (drop if key in seen else keep).append(item)
        seen.add(key)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
