"""CPU workers' runtime preloads: only libraries that exist, ahead of the caller's own preloads,
never twice; the launcher gives them to CPU workers only, and a worker it starts really maps them."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pagedkv import cpu_runtime


def test_only_present_libraries_are_named(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(cpu_runtime, "TCMALLOC_CANDIDATES", (str(tmp_path / "missing.so"),))
    monkeypatch.setattr(sys, "prefix", str(tmp_path))
    assert cpu_runtime.runtime_libraries() == []
    assert cpu_runtime.preload_env({}) == {}
    tc = tmp_path / "libtcmalloc_minimal.so.4"
    tc.write_bytes(b"")
    (tmp_path / "lib").mkdir()
    iomp = tmp_path / "lib" / "libiomp5.so"
    iomp.write_bytes(b"")
    monkeypatch.setattr(cpu_runtime, "TCMALLOC_CANDIDATES", (str(tmp_path / "missing.so"), str(tc)))
    assert cpu_runtime.runtime_libraries() == [str(tc), str(iomp)]
    assert cpu_runtime.preload_env({"LD_PRELOAD": "/x/mine.so"}) == {"LD_PRELOAD": f"{tc}:{iomp}:/x/mine.so"}
    # Already preloaded: nothing to add (not named twice).
    assert cpu_runtime.preload_env({"LD_PRELOAD": f"{iomp} {tc}"}) == {}
    # Another copy of the same library (e.g. another venv's libiomp5.so) counts as there.
    assert cpu_runtime.preload_env({"LD_PRELOAD": "/other/venv/lib/libiomp5.so"}) == {
        "LD_PRELOAD": f"{tc}:/other/venv/lib/libiomp5.so"
    }


def test_launcher_preloads_cpu_workers_only(monkeypatch: pytest.MonkeyPatch) -> None:
    from pagedkv.frontend.launch import processes as stack

    monkeypatch.setattr(stack, "preload_env", lambda: {"LD_PRELOAD": "/lib/fast.so"})
    workers = [
        s for s in stack.plan(stack.StackConfig(num_workers=2, device="cpu")) if s.name.startswith("worker")
    ]
    assert [w.env for w in workers] == [{"LD_PRELOAD": "/lib/fast.so"}] * 2
    others = [
        s
        for s in stack.plan(stack.StackConfig(device="cpu", serve_port=8000))
        if not s.name.startswith("worker")
    ]
    assert all("LD_PRELOAD" not in s.env for s in others)
    assert all(not s.env for s in stack.plan(stack.StackConfig(device="cuda")) if s.name.startswith("worker"))
    opts = stack.StackConfig(device="cpu", preload_runtime=False)
    assert all(not s.env for s in stack.plan(opts) if s.name.startswith("worker"))
    args = stack.build_parser().parse_args(["--no-preload-runtime"])
    assert stack.options_from_args(args).preload_runtime is False


@pytest.mark.skipif(
    not cpu_runtime.runtime_libraries(), reason="neither tcmalloc nor intel-openmp is installed"
)
def test_a_worker_started_by_the_launcher_maps_the_runtime_libraries(tmp_path: Path) -> None:
    from pagedkv.frontend.launch.config import StackConfig
    from pagedkv.frontend.launch.processes import Stack
    from pagedkv.ports import free_ports

    bm, ch, w = free_ports(3)
    st = Stack(
        StackConfig(
            block_manager_port=bm,
            cache_host_port=ch,
            worker_port=w,
            num_workers=1,
            num_gpu_blocks=64,
            num_cpu_blocks=0,
            device="cpu",
            log_dir=str(tmp_path),
        ),
        out=sys.stderr,
    )
    st.start()
    try:
        worker = next(s for s in st.services if s.name == "worker-0")
        assert worker.process is not None
        maps = Path(f"/proc/{worker.process.pid}/maps").read_text()
    finally:
        st.stop()
    for lib in cpu_runtime.runtime_libraries():
        assert lib in maps, lib


def test_the_openmp_registration_of_an_exited_process_is_removed_and_a_live_ones_kept(tmp_path: Path) -> None:
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()
    uid = os.getuid()
    left = tmp_path / f"__KMP_REGISTERED_LIB_{gone.pid}_{uid}"
    left.write_bytes(b"x")
    other = tmp_path / f"__KMP_REGISTERED_LIB_{gone.pid}1_{uid}"  # another pid's: untouched
    other.write_bytes(b"x")
    assert cpu_runtime.remove_openmp_registration(gone.pid, tmp_path) == left
    assert not left.exists() and other.exists()
    assert cpu_runtime.remove_openmp_registration(gone.pid, tmp_path) is None  # nothing left to remove
    mine = tmp_path / f"__KMP_REGISTERED_LIB_{os.getpid()}_{uid}"  # a running process: its own file
    mine.write_bytes(b"x")
    assert cpu_runtime.remove_openmp_registration(os.getpid(), tmp_path) is None
    assert mine.exists()


@pytest.mark.skipif(
    cpu_runtime.intel_openmp() is None, reason="intel-openmp is not installed (the worker extra)"
)
def test_a_killed_process_leaves_the_openmp_runtimes_file_which_is_then_removed() -> None:
    script = "import time, torch; x = torch.randn(400, 400); x.mm(x); print('up', flush=True); time.sleep(60)"
    env = {**os.environ, "LD_PRELOAD": str(cpu_runtime.intel_openmp()), "OMP_NUM_THREADS": "2"}
    p = subprocess.Popen([sys.executable, "-c", script], env=env, stdout=subprocess.PIPE, text=True)
    try:
        assert p.stdout is not None and p.stdout.readline().strip() == "up"
        path = Path("/dev/shm") / f"__KMP_REGISTERED_LIB_{p.pid}_{os.getuid()}"
        deadline = time.monotonic() + 10
        while not path.exists():
            assert time.monotonic() < deadline, "the runtime registered no file"
            time.sleep(0.05)
        p.send_signal(signal.SIGKILL)
        p.wait()
        assert path.exists()  # what a killed worker leaves
        assert cpu_runtime.remove_openmp_registration(p.pid) == path
        assert not path.exists()
    finally:
        p.kill()
        p.wait()
