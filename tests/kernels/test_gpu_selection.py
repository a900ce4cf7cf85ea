"""Nothing in bench/gpu_check.sh's pytest selection (tests/kernels) needs a CPU-only feature there.

The CPU-only features are the native C kernels (kernels/cpu/native.py) and the CPU backend
(kernels/cpu/attention.py): both read host memory. Every test module that uses them runs here as on the GPU
image (tests/kernels/gpu_image_plugin.py: CUDA "available", ``cases.DEVICE`` not the CPU): each of
its tests must pass on CPU tensors it builds itself, or skip itself, never touch a device tensor.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Mapping
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
CPU_ONLY = re.compile(r"\bcpu_native\b|from pagedkv.kernels.cpu\b|from pagedkv.kernels import [^\n]*\bcpu\b")


def _cpu_feature_modules() -> list[Path]:
    return sorted(
        p
        for p in (ROOT / "tests" / "kernels").rglob("test_*.py")
        if p.name != Path(__file__).name and CPU_ONLY.search(p.read_text())
    )


def inner_env(outer: Mapping[str, str]) -> dict[str, str]:
    """The inner pytest's environment: the checkout first, then the inherited PYTHONPATH (on the GPU
    image that is where gpu_check.sh put the wheelhouse, structlog included)."""
    inherited = outer.get("PYTHONPATH", "")
    env = dict(outer, PYTHONPATH=os.pathsep.join(p for p in (str(ROOT), inherited) if p), OMP_NUM_THREADS="1")
    env.pop("PAGEDKV_KERNEL_BACKEND", None)
    return env


def test_the_inner_pytest_keeps_the_inherited_pythonpath() -> None:
    env = inner_env({"PYTHONPATH": "/wheelhouse/deps:/more", "PAGEDKV_KERNEL_BACKEND": "cpu"})
    assert env["PYTHONPATH"].split(os.pathsep) == [str(ROOT), "/wheelhouse/deps", "/more"]
    assert "PAGEDKV_KERNEL_BACKEND" not in env
    assert inner_env({})["PYTHONPATH"] == str(ROOT)


def test_cpu_only_kernel_tests_hold_on_the_gpu_image() -> None:
    modules = _cpu_feature_modules()
    assert {p.relative_to(ROOT).as_posix() for p in modules} >= {
        "tests/kernels/cpu/test_attention.py",
        "tests/kernels/cpu/test_native.py",
    }
    env = inner_env(os.environ)
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-p",
            "no:cacheprovider",
            "-p",
            "tests.kernels.gpu_image_plugin",
            "-k",
            "not compile_sm90",
            *map(str, modules),
        ],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode == 0, proc.stdout[-4000:] + proc.stderr[-2000:]
    assert re.search(r"\d+ passed", proc.stdout), proc.stdout[-2000:]
