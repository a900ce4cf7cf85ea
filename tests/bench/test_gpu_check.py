"""bench/gpu_check.sh rehearsed on CPU: the plumbing a one-shot GPU run depends on.

Nothing is faked: the script runs as it would on the GPU machine, finds no GPU, and its GPU
sections say "no GPU". What is checked is what a borrowed machine punishes: $OUT holds at most 8
files (here exactly three: status.md, results.md and a tarball of every log), the global deadline
skips what no longer fits, versions are recorded, and the wheelhouse installs offline into the
dependency folder the sections import from.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import zipfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
GPU_SECTIONS = ("pytest", "ipc", "bench", "worker", "pd")


def _wheelhouse(path: Path) -> Path:
    """A real (tiny, pure-Python) wheel plus requirements.txt, as tools/gpu_wheels.sh lays them out."""
    path.mkdir()
    name, ver = "pagedkv_rehearsal", "0.1"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{name}-{ver}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n",
        f"{name}-{ver}.dist-info/WHEEL": "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = "".join(f"{f},,\n" for f in files) + f"{name}-{ver}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path / f"{name}-{ver}-py3-none-any.whl", "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
        z.writestr(f"{name}-{ver}.dist-info/RECORD", record)
    (path / "requirements.txt").write_text(f"{name}=={ver}\n")
    return path


def _run(tmp_path: Path, *args: str, **env: str) -> tuple[subprocess.CompletedProcess[str], Path, float]:
    out = tmp_path / "out"
    full_env = {**os.environ, "OUT": str(out), "PYTHON": sys.executable, "CUDA_VISIBLE_DEVICES": "",
                "WHEELHOUSE": str(tmp_path / "wheels"), "PYDEPS": str(tmp_path / "pydeps"), **env}
    t0 = time.monotonic()
    proc = subprocess.run(["bash", str(SCRIPT), *args], cwd=tmp_path, env=full_env, capture_output=True,
                          text=True, timeout=120)
    return proc, out, time.monotonic() - t0


def _rows(status: str) -> dict[str, str]:
    rows = {}
    for line in status.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "section":
            rows[cells[0]] = cells[1]
    return rows


def test_rehearsal_without_a_gpu(tmp_path: Path) -> None:
    _wheelhouse(tmp_path / "wheels")
    proc, out, took = _run(tmp_path, "--rehearse")
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert took < 30
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "results.md", "status.md"]
    status = (out / "status.md").read_text()
    rows = _rows(status)
    assert rows == {"wheels": "ok", "env": "ok", **{s: "no GPU" for s in GPU_SECTIONS}}, status
    assert "mode: rehearsal; GPU: no GPU" in status
    for name in ("kernel ", "python ", "torch ", "triton ", "numpy ", "grpcio ", "protobuf ", "cupy ", "cuda: no GPU"):
        assert f"\n{name}" in status, name
    # The wheelhouse was installed offline into PYDEPS, importable the way the sections import it.
    check = subprocess.run([sys.executable, "-c", "import pagedkv_rehearsal as m; print(m.VALUE)"],
                           env=dict(os.environ, PYTHONPATH=str(tmp_path / "pydeps")), capture_output=True, text=True)
    assert check.stdout.strip() == "42", check.stderr
    assert "pydantic " in status
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        names = {Path(n).name for n in tar.getnames()}
    assert {"env.txt", "wheels.txt", "versions.txt", "status.md", *(f"{s}.txt" for s in GPU_SECTIONS)} <= names
    assert (out / "results.md").read_text().startswith("# gpu_check results")
    assert proc.stdout.rstrip().endswith("# gpu_check results")  # status then results are printed last


def test_deadline_skips_what_does_not_fit_and_no_gpu_fails_outside_rehearsal(tmp_path: Path) -> None:
    proc, out, _ = _run(tmp_path, DEADLINE_S="0")
    assert proc.returncode == 1
    status = (out / "status.md").read_text()
    assert set(_rows(status).values()) == {"SKIPPED (deadline)"}, status
    assert len(_rows(status)) == 2 + len(GPU_SECTIONS)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "results.md", "status.md"]
    # No deadline problem, but no GPU and no --rehearse: nothing was measured, so it fails.
    proc, out, _ = _run(tmp_path, WHEELHOUSE=str(tmp_path / "none"))
    assert proc.returncode == 1 and "no GPU: nothing was measured" in proc.stderr
    assert _rows((out / "status.md").read_text())["wheels"] == "ok"  # no wheelhouse: uses the image's packages
