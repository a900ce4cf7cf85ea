"""bench/gpu_check.sh rehearsed on CPU: the plumbing a one-shot GPU run depends on.

Nothing is faked: the script runs as it would on the GPU machine and finds no GPU. Under
``--rehearse`` every GPU section runs its CPU form under the same timeout (the exact pytest
selection collected, kernel_bench --smoke, gpu_worker_check --device cpu, the short pd form on CPU).
What is checked is what a borrowed machine punishes: $OUT holds at most 8 files (here exactly
three), the global deadline skips what no longer fits, versions are recorded, the wheelhouse
installs offline and, in full mode, a missing or incomplete one fails the wheels section (checked
with an "image" interpreter that lacks structlog and pydantic, as the GPU image does), and a
section that times out leaves no process behind, services in sessions of their own included.
"""

from __future__ import annotations

import os
import subprocess
import sys
import tarfile
import time
import uuid
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "gpu_check.sh"
GPU_SECTIONS = ("pytest", "ipc", "bench", "worker", "graphs", "pd")
BUDGETS = {
    "wheels": 40,
    "env": 20,
    "pytest": 110,
    "ipc": 40,
    "bench": 70,
    "worker": 50,
    "graphs": 40,
    "pd": 85,
}
IMAGE_LACKS = ("structlog", "pydantic", "pydantic_core", "pydantic_settings")  # as the GPU image does


def _wheelhouse(path: Path) -> Path:
    """A real (tiny, pure-Python) wheel plus requirements.txt, as tools/gpu_wheels.sh lays them out."""
    path.mkdir()
    name, ver = "pagedkv_rehearsal", "0.1"
    files = {
        f"{name}/__init__.py": "VALUE = 42\n",
        f"{name}-{ver}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {ver}\n",
        f"{name}-{ver}.dist-info/WHEEL": (
            "Wheel-Version: 1.0\nGenerator: test\nRoot-Is-Purelib: true\nTag: py3-none-any\n"
        ),
    }
    record = "".join(f"{f},,\n" for f in files) + f"{name}-{ver}.dist-info/RECORD,,\n"
    with zipfile.ZipFile(path / f"{name}-{ver}-py3-none-any.whl", "w") as z:
        for f, text in files.items():
            z.writestr(f, text)
        z.writestr(f"{name}-{ver}.dist-info/RECORD", record)
    (path / "requirements.txt").write_text(f"{name}=={ver}\n")
    return path


def _env(tmp_path: Path, **env: str) -> dict[str, str]:
    return {
        **os.environ,
        "OUT": str(tmp_path / "out"),
        "PYTHON": sys.executable,
        "CUDA_VISIBLE_DEVICES": "",
        "WHEELHOUSE": str(tmp_path / "wheels"),
        "PYDEPS": str(tmp_path / "pydeps"),
        **env,
    }


def _run(
    tmp_path: Path, *args: str, timeout: float = 120, **env: str
) -> tuple[subprocess.CompletedProcess[str], Path, float]:
    t0 = time.monotonic()
    proc = subprocess.run(
        ["bash", str(SCRIPT), *args],
        cwd=tmp_path,
        env=_env(tmp_path, **env),
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    return proc, tmp_path / "out", time.monotonic() - t0


def _rows(status: str) -> dict[str, tuple[str, int]]:
    """section -> (result, seconds taken)."""
    rows = {}
    for line in status.splitlines():
        cells = [c.strip() for c in line.strip("|").split("|")]
        if line.startswith("| ") and len(cells) == 4 and cells[0] != "section":
            rows[cells[0]] = (cells[1], int(cells[2].rstrip("s")) if cells[2].rstrip("s").isdigit() else -1)
    return rows


def _log(out: Path, name: str) -> str:
    with tarfile.open(out / "gpu_check.tar.gz") as tar:
        member = next(m for m in tar.getmembers() if Path(m.name).name == name)
        f = tar.extractfile(member)
        assert f is not None
        return f.read().decode()


def _tagged(tag: str) -> list[int]:
    """Live processes whose environment carries PAGEDKV_GPU_CHECK_TAG=tag (what gpu_check sweeps)."""
    want = f"PAGEDKV_GPU_CHECK_TAG={tag}".encode()
    pids = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if want in (p / "environ").read_bytes().split(b"\0"):
                    pids.append(int(p.name))
            except OSError:
                pass
    return pids


def _running(pid: int) -> bool:
    """Alive and not a zombie (a zombie holds no memory; its parent, or init, reaps it)."""
    try:
        return (Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return False


def _cmdline(pid: int) -> str:
    try:
        return (Path("/proc") / str(pid) / "cmdline").read_bytes().replace(b"\0", b" ").decode()
    except OSError:
        return ""


@pytest.mark.timeout(1500)
def test_rehearsal_runs_every_section_on_cpu_within_its_budget(tmp_path: Path) -> None:
    _wheelhouse(tmp_path / "wheels")
    # REHEARSAL_SLACK: this test shares 2 cores with other work; on a quiet machine the rehearsal
    # fits the GPU budgets themselves (docs/gpu.md has a quiet run's times).
    slack = int(os.environ.get("PAGEDKV_TEST_REHEARSAL_SLACK", "3"))
    proc, out, took = _run(
        tmp_path, "--rehearse", timeout=sum(BUDGETS.values()) * slack + 60, REHEARSAL_SLACK=str(slack)
    )
    status = (out / "status.md").read_text()
    assert proc.returncode == 0, status + proc.stdout[-3000:] + proc.stderr[-3000:]
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "results.md", "status.md"]
    rows = _rows(status)
    assert {k: v[0] for k, v in rows.items()} == {
        "wheels": "ok",
        "env": "ok",
        **{s: "ok (CPU rehearsal)" for s in GPU_SECTIONS},
    }, status
    for name, (_, secs) in rows.items():
        assert secs <= BUDGETS[name] * slack, (name, secs)
    assert took < sum(BUDGETS.values()) * slack + 30
    assert "mode: rehearsal; GPU: no GPU" in status
    for name in (
        "kernel ",
        "python ",
        "torch ",
        "triton ",
        "numpy ",
        "grpcio ",
        "protobuf ",
        "cupy ",
        "cuda: no GPU",
        "google.protobuf.__version__ ",
        "grpc ",
    ):
        assert f"\n{name}" in status, name
    # The wheelhouse was installed offline into PYDEPS, importable the way the sections import it.
    check = subprocess.run(
        [sys.executable, "-c", "import pagedkv_rehearsal as m; print(m.VALUE)"],
        env=dict(os.environ, PYTHONPATH=str(tmp_path / "pydeps")),
        capture_output=True,
        text=True,
    )
    assert check.stdout.strip() == "42", check.stderr
    assert "imports ok" in _log(out, "wheels.txt")
    # Each rehearsal really ran its section's selection: the kernel tests collected with loadfile's
    # flags, the IPC test id found, both kernel_bench tables, the CPU worker check, both pd layouts.
    assert "tests collected" in _log(out, "pytest.txt")
    assert "test_graphs_give_the_eager_greedy_tokens_on_cuda" in _log(out, "pytest.txt")
    assert "1 test collected" in _log(out, "ipc.txt")
    results = (out / "results.md").read_text()
    assert results.startswith("# gpu_check results")
    assert "## decode" in results and "## prefill" in results
    assert "skipped: time budget" not in results
    assert "multi-process shared cache over shm: PASS" in results
    assert "## decode step time, eager vs CUDA graphs (cpu;" in results
    assert "| mixed x1 (t" in results and "| prefill+decode |" in results
    assert proc.stdout.rstrip().endswith(
        results.rstrip().splitlines()[-1]
    )  # status then results are printed last


def test_deadline_skips_what_does_not_fit_and_no_gpu_fails_outside_rehearsal(tmp_path: Path) -> None:
    proc, out, _ = _run(tmp_path, DEADLINE_S="0")
    assert proc.returncode == 1
    status = (out / "status.md").read_text()
    assert {v[0] for v in _rows(status).values()} == {"SKIPPED (deadline)"}, status
    assert len(_rows(status)) == 2 + len(GPU_SECTIONS)
    assert sorted(p.name for p in out.iterdir()) == ["gpu_check.tar.gz", "results.md", "status.md"]
    # Full mode without a wheelhouse: the image lacks the services' dependencies, so wheels FAILS;
    # and with no GPU and no --rehearse nothing was measured, so it fails.
    proc, out, _ = _run(tmp_path, WHEELHOUSE=str(tmp_path / "none"))
    assert proc.returncode == 1 and "no GPU: nothing was measured" in proc.stderr
    rows = _rows((out / "status.md").read_text())
    assert rows["wheels"][0].startswith("FAILED") and all(rows[s][0] == "no GPU" for s in GPU_SECTIONS)
    assert "no wheelhouse at" in _log(out, "wheels.txt")


@pytest.fixture(scope="module")
def image_python(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An interpreter with this venv's packages minus structlog and pydantic: the GPU image's situation."""
    base = tmp_path_factory.mktemp("image")
    subprocess.run(
        [getattr(sys, "_base_executable", sys.executable), "-m", "venv", "--without-pip", str(base / "venv")],
        check=True,
    )
    site = next((base / "venv" / "lib").glob("python3*/site-packages"))
    pkgs = base / "image-packages"
    pkgs.mkdir()
    mine = next(Path(p) for p in sys.path if p.endswith("site-packages") and Path(p).is_dir())
    for entry in mine.iterdir():
        if entry.name.split("-")[0].split(".")[0].lower() not in IMAGE_LACKS and not entry.name.startswith(
            "__editable__"
        ):
            (pkgs / entry.name).symlink_to(entry)
    (site / "image.pth").write_text(f"{pkgs}\n")
    py = base / "venv" / "bin" / "python"
    lacks = subprocess.run([str(py), "-c", "import structlog"], capture_output=True, text=True)
    assert lacks.returncode != 0, "the image interpreter must lack structlog"
    return py


@pytest.mark.timeout(300)
def test_full_mode_fails_the_wheels_section_on_an_incomplete_wheelhouse(
    tmp_path: Path, image_python: Path
) -> None:
    _wheelhouse(tmp_path / "wheels")  # installs fine, but holds none of the services' dependencies
    proc, out, _ = _run(tmp_path, PYTHON=str(image_python), GPU_CHECK_ONLY="wheels,env")
    rows = _rows((out / "status.md").read_text())
    assert rows["wheels"][0].startswith("FAILED"), rows
    log = _log(out, "wheels.txt")
    for mod in ("structlog", "pydantic", "pydantic_settings", "worker_svc.server"):
        assert f"MISSING {mod} " in log, log[-3000:]


@pytest.mark.timeout(300)
def test_full_mode_passes_with_the_wheelhouse_gpu_wheels_builds(tmp_path: Path, image_python: Path) -> None:
    build = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_wheels.sh"), "--native", str(tmp_path / "wheels")],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        timeout=240,
        env={k: v for k, v in os.environ.items() if k != "PYTHON"},
    )
    assert build.returncode == 0, build.stdout[-2000:] + build.stderr[-2000:]
    proc, out, _ = _run(tmp_path, PYTHON=str(image_python), GPU_CHECK_ONLY="wheels,env", timeout=240)
    status = (out / "status.md").read_text()
    rows = _rows(status)
    assert rows["wheels"][0] == "ok" and rows["env"][0] == "ok", status + _log(out, "wheels.txt")[-3000:]
    log = _log(out, "wheels.txt")
    assert "imports ok" in log
    assert "google.protobuf " in log and " from " in log
    # What the sections import is the wheelhouse's copy, reported with its version and file.
    assert "\nstructlog MISSING" not in status and "\npydantic MISSING" not in status, status
    assert "google.protobuf.__version__ " in status and f"from {tmp_path / 'pydeps'}" in status, status


def test_gpu_wheels_reads_versions_from_the_project_venv_not_path(tmp_path: Path) -> None:
    fake = tmp_path / "bin"
    fake.mkdir()
    (fake / "python").write_text("#!/bin/sh\necho 'the first python on PATH' >&2; exit 3\n")
    (fake / "python").chmod(0o755)
    env = {k: v for k, v in os.environ.items() if k != "PYTHON"}
    env["PATH"] = f"{fake}:{env['PATH']}"
    # --native against a missing package index would download; the versions step comes first and is
    # what this checks: it must name the project's venv interpreter.
    proc = subprocess.run(
        ["bash", str(ROOT / "tools" / "gpu_wheels.sh"), "--native", str(tmp_path / "w")],
        cwd=tmp_path,
        env=env,
        capture_output=True,
        text=True,
        timeout=240,
    )
    assert "the first python on PATH" not in proc.stderr
    assert f"versions from {ROOT / '.venv' / 'bin' / 'python'}" in proc.stdout, (
        proc.stdout[-2000:] + proc.stderr[-2000:]
    )


@pytest.mark.timeout(300)
def test_a_timed_out_section_leaves_no_process_behind(tmp_path: Path) -> None:
    """The pd rehearsal starts real stacks (services in sessions of their own) and is cut off mid-run."""
    run_id = uuid.uuid4().hex[:12]
    tag = f"{run_id}-pd"
    env = _env(
        tmp_path,
        GPU_CHECK_ONLY="pd",
        GPU_CHECK_RUN_ID=run_id,
        PD_TIMEOUT_S="30",
        # Both layouts at these sizes took 120 s uncut on the 2-core machine, so the cut always
        # comes mid-run. (3,000 tokens x 8 decoders took 44 s there once the worker got faster:
        # a 45 s timeout let it finish.) 4,000 + 32 prompt tokens stays inside the model's 4,096.
        PD_ARGS="--decode-tokens 4000 --decoders 16 --num-gpu-blocks 4500",
    )
    p = subprocess.Popen(
        ["bash", str(SCRIPT), "--rehearse"],
        cwd=tmp_path,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
    )
    services_seen: set[int] = set()
    own_session: set[int] = set()
    while p.poll() is None:
        for pid in _tagged(tag):
            if "pagedkv" in _cmdline(pid) and ("cache-host" in _cmdline(pid) or " worker " in _cmdline(pid)):
                services_seen.add(pid)
                try:
                    if os.getsid(pid) == pid:
                        own_session.add(pid)
                except OSError:
                    pass
        time.sleep(0.5)
    stdout = p.stdout.read() if p.stdout else ""
    status = (tmp_path / "out" / "status.md").read_text()
    assert _rows(status)["pd"][0] == "TIMEOUT (CPU rehearsal)", status + stdout[-2000:]
    assert services_seen, "the section was cut off before its stack started: nothing tested"
    assert own_session, "the services run in sessions of their own (what a process-group kill misses)"
    left = _tagged(tag)
    assert not left, [(pid, _cmdline(pid)) for pid in left]
    assert not [pid for pid in services_seen if _running(pid)]
