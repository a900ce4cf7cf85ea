"""A process started with parent_watch.ENV naming its parent stops (SIGTERM, its orderly stop) once
that parent is gone, and only then; a variable naming another process starts no watch."""

from __future__ import annotations

import os
import pathlib
import signal
import subprocess
import sys
import textwrap
import time

from pagedkv import parent_watch

ROOT = pathlib.Path(__file__).resolve().parents[2]

# The role stand-in: watches its launcher, then waits; SIGTERM writes a mark and exits 0.
CHILD = textwrap.dedent("""
    import pathlib, signal, sys, time
    from pagedkv import parent_watch
    mark = pathlib.Path(sys.argv[1])
    def stop(*_):
        mark.write_text("stopped")
        sys.exit(0)
    signal.signal(signal.SIGTERM, stop)
    pathlib.Path(sys.argv[2]).write_text(str(parent_watch.start_from_env(interval_s=0.05)))
    time.sleep(60)
""")

# The launcher stand-in: argv mark, watching, the pid ENV names ("": its own), the child's code.
# Starts the child in a session of its own (as processes.launch does), prints its pid, sleeps.
LAUNCHER = textwrap.dedent("""
    import os, subprocess, sys, time
    from pagedkv import parent_watch
    mark, watching, named, code = sys.argv[1:5]
    env = {**os.environ, parent_watch.ENV: named or str(os.getpid())}
    child = subprocess.Popen([sys.executable, "-c", code, mark, watching], env=env, start_new_session=True)
    print(child.pid, flush=True)
    time.sleep(60)
""")


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:  # a zombie (exited, not reaped) is gone for us
        return f.read().rsplit(")", 1)[1].split()[0] != "Z"


def _start(tmp_path: pathlib.Path, named: str = "") -> tuple[subprocess.Popen[str], int]:
    launcher = subprocess.Popen(
        [sys.executable, "-c", LAUNCHER, str(tmp_path / "mark"), str(tmp_path / "watching"), named, CHILD],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        text=True,
        env={**os.environ, "PYTHONPATH": str(ROOT)},
    )
    assert launcher.stdout is not None
    child = int(launcher.stdout.readline())
    deadline = time.monotonic() + 30
    while not (tmp_path / "watching").exists():
        assert time.monotonic() < deadline, "the child never started"
        time.sleep(0.05)
    return launcher, child


def test_a_child_stops_when_its_launcher_is_killed(tmp_path: pathlib.Path) -> None:
    launcher, child = _start(tmp_path)
    try:
        assert (tmp_path / "watching").read_text() == "True"
        time.sleep(0.3)
        assert _alive(child) and not (tmp_path / "mark").exists()  # no stop while the launcher lives
        launcher.send_signal(signal.SIGKILL)
        launcher.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
        assert (tmp_path / "mark").read_text() == "stopped"  # through its SIGTERM handler
    finally:
        launcher.kill()
        if _alive(child):
            os.kill(child, signal.SIGKILL)


def test_a_variable_naming_another_process_starts_no_watch(tmp_path: pathlib.Path) -> None:
    launcher, child = _start(tmp_path, named="1")
    try:
        assert (tmp_path / "watching").read_text() == "False"
    finally:
        launcher.kill()
        launcher.wait()
        os.kill(child, signal.SIGKILL)
    assert not parent_watch.start_from_env({})
    assert not parent_watch.start_from_env({parent_watch.ENV: "not a pid"})
