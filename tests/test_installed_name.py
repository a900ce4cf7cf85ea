"""Installing pagedkv adds one top-level import name, `pagedkv`, and it sits beside Hugging Face's
`kernels` package (which transformers imports): the checkout's kernels/, frontend/,
block_manager_svc/ and worker_svc/ folders are installed as pagedkv's subpackages only.

The wheel is built from a copy of the checkout's sources (what git tracks, and what it does not
ignore, symlinks kept as symlinks): a build/ folder left by an earlier build of the checkout would
otherwise be packed into the wheel too. It is installed into a fresh virtual environment with
Hugging Face's `kernels` from the package index, both without their dependencies; the project's
own environment is appended to that environment's path (a .pth file) for torch, numpy and the
rest, and the checkout is not on it, so `pagedkv` can only come from the wheel. Needs the package
index: without it the install fails, and so does the test.
"""

from __future__ import annotations

import json
import os
import pathlib
import shutil
import stat
import subprocess
import sys
import sysconfig
import venv
import zipfile

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
FOLDERS = ("kernels", "frontend", "block_manager_svc", "worker_svc")
COMPILER = shutil.which("cc") or shutil.which("gcc")

# Run by the fresh environment's interpreter, from an empty directory: where each name comes from.
PROBE = """
import importlib, importlib.util, json, sys
OLD = ("frontend", "block_manager_svc", "worker_svc")
import kernels
import pagedkv.kernels
from pagedkv.kernels.cpu import native as cpu_native
for name in ("pagedkv.cli", "pagedkv.frontend.engine", "pagedkv.frontend.launch.processes",
             "pagedkv.block_manager_svc.server", "pagedkv.worker_svc.server",
             "pagedkv.kernels.cpu.attention"):
    importlib.import_module(name)
print(json.dumps({
    "kernels": kernels.__file__,
    "pagedkv.kernels": pagedkv.kernels.__file__,
    "pagedkv": [m.__file__ for n, m in sys.modules.items() if n.split(".")[0] == "pagedkv"],
    "old names": {n: importlib.util.find_spec(n) is not None for n in OLD},
    "loaded old names": sorted(n for n in sys.modules if n.split(".")[0] in OLD),
    "native": cpu_native.built_variants(),
    "native path": str(cpu_native.artifact("generic")),
}))
"""


def _copy_sources(dest: pathlib.Path) -> None:
    out = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=ROOT,
        capture_output=True,
        check=True,
    )
    for name in sorted(set(out.stdout.decode().split("\0")) - {""}):
        src, dst = ROOT / name, dest / name
        if not src.is_symlink() and not src.is_file():
            continue  # deleted in the working tree, or a submodule
        dst.parent.mkdir(parents=True, exist_ok=True)
        if src.is_symlink():
            dst.symlink_to(os.readlink(src))
        else:
            shutil.copy2(src, dst)


def _pip(*args: str, timeout: int = 300) -> None:
    done = subprocess.run(
        [sys.executable, "-m", "pip", "--disable-pip-version-check", *args],
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert done.returncode == 0, f"pip {' '.join(args)} failed:\n{done.stdout[-2000:]}\n{done.stderr[-3000:]}"


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """The package's wheel, built with only the generic native variant (setup.py: a quick build)."""
    base = tmp_path_factory.mktemp("wheel")
    _copy_sources(base / "src")
    env = {**os.environ, "PAGEDKV_BUILD_MACHINE": "generic"}
    env.pop("PYTHONPATH", None)
    done = subprocess.run(
        [
            sys.executable,
            "-m",
            "pip",
            "--disable-pip-version-check",
            "wheel",
            "--no-deps",
            "--no-build-isolation",  # the project environment's setuptools: no index needed here
            "-w",
            str(base / "dist"),
            str(base / "src"),
        ],
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
    (whl,) = (base / "dist").glob("pagedkv-*.whl")
    return whl


def _top_level(names: list[str]) -> set[str]:
    """The first path component of each file, less the wheel's .dist-info and .data folders."""
    return {n.split("/")[0] for n in names if not n.split("/")[0].endswith((".dist-info", ".data"))}


def test_the_wheel_holds_one_top_level_name_with_real_files(wheel: pathlib.Path) -> None:
    with zipfile.ZipFile(wheel) as z:
        names = z.namelist()
        (record,) = [n for n in names if n.endswith(".dist-info/RECORD")]
        recorded = [line.split(",")[0] for line in z.read(record).decode().splitlines() if line]
        top_level = [n for n in names if n.endswith(".dist-info/top_level.txt")]
        if top_level:
            assert z.read(top_level[0]).decode().split() == ["pagedkv"]
        symlinks = [i.filename for i in z.infolist() if stat.S_ISLNK(i.external_attr >> 16)]
    assert _top_level(names) == {"pagedkv"}
    assert _top_level(recorded) == {"pagedkv"}
    assert symlinks == []  # the folders' files themselves, not links to a checkout
    for folder in FOLDERS:
        assert f"pagedkv/{folder}/__init__.py" in names, folder
    assert {"pagedkv/kernels/cpu/native.py", "pagedkv/frontend/engine/engine.py"} <= set(names)
    if COMPILER is not None:
        assert [n for n in names if n.startswith("pagedkv/kernels/cpu/_native_generic.")], (
            "the native library"
        )


@pytest.fixture(scope="module")
def fresh_env(wheel: pathlib.Path, tmp_path_factory: pytest.TempPathFactory) -> pathlib.Path:
    """A new virtual environment with the wheel and Hugging Face's `kernels` (from the index), and
    the project environment's packages after its own."""
    target = tmp_path_factory.mktemp("venv") / "env"
    venv.create(target, with_pip=False)
    python = target / "bin" / "python"
    _pip("--python", str(python), "install", "--no-deps", str(wheel))
    _pip("--python", str(python), "install", "--no-deps", "--only-binary=:all:", "kernels")
    site = subprocess.run(
        [str(python), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    # After the environment's own site-packages: torch, numpy, grpc, huggingface_hub for the imports.
    (pathlib.Path(site) / "zz_project_packages.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    return target


def test_hugging_faces_kernels_and_pagedkv_kernels_import_side_by_side(
    fresh_env: pathlib.Path, tmp_path: pathlib.Path
) -> None:
    env = {k: v for k, v in os.environ.items() if not k.startswith("PYTHON")}
    done = subprocess.run(
        [str(fresh_env / "bin" / "python"), "-c", PROBE],
        cwd=tmp_path,  # not the checkout: its folders must not be importable
        env=env,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    got = json.loads(done.stdout.splitlines()[-1])
    site = str(fresh_env.resolve())
    assert got["kernels"].startswith(site) and "/site-packages/kernels/" in got["kernels"], got["kernels"]
    assert got["pagedkv.kernels"].startswith(site), got["pagedkv.kernels"]
    assert got["pagedkv.kernels"].endswith("/site-packages/pagedkv/kernels/__init__.py")
    outside = [f for f in got["pagedkv"] if f and not f.startswith(site)]
    assert outside == [], "pagedkv modules loaded from outside the fresh environment"
    assert got["old names"] == {"frontend": False, "block_manager_svc": False, "worker_svc": False}
    assert got["loaded old names"] == []
    if COMPILER is not None:
        assert got["native"] == ["generic"]
        assert got["native path"].startswith(site)
