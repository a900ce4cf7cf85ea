"""`pagedkv up` as a child process, the one way the tests start it: ready when its ``--ready-file``
is written (frontend/launch/ready.py), its output (stdout and stderr) collected line by line."""

from __future__ import annotations

import os
import pathlib
import re
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Mapping, Sequence
from types import TracebackType

from pagedkv.frontend.launch.ready import StackReady, wait_ready_file

ROOT = pathlib.Path(__file__).resolve().parents[2]


def _as_users_run_it(env: Mapping[str, str]) -> dict[str, str]:
    """``env`` without TRITON_INTERPRET: the suite sets it for the in-process kernel tests
    (tests/conftest.py), and a stack inheriting it would run attention in Triton's interpreter on
    CPU, hundreds of times slower than the native kernels a user's stack runs."""
    return {k: v for k, v in env.items() if k != "TRITON_INTERPRET"}


class UpProcess:
    """``pagedkv up ARGS --ready-file DIR/ready.json``; ``with`` stops it (SIGINT, then SIGKILL)."""

    def __init__(
        self, args: Sequence[str], work_dir: pathlib.Path, env: Mapping[str, str] | None = None
    ) -> None:
        self.ready_file = work_dir / "up-ready.json"
        self.p = subprocess.Popen(
            [sys.executable, "-m", "pagedkv.cli", "up", *args, "--ready-file", str(self.ready_file)],
            cwd=ROOT,
            env=_as_users_run_it(env if env is not None else os.environ),
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )
        self.lines: list[str] = []
        self._cv = threading.Condition()
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.p.stdout is not None
        for line in self.p.stdout:
            with self._cv:
                self.lines.append(line)
                self._cv.notify_all()

    def output(self) -> str:
        with self._cv:
            return "".join(self.lines)

    def wait_ready(self, timeout_s: float = 120.0) -> StackReady:
        try:
            return wait_ready_file(self.ready_file, self.p, timeout_s)
        except (RuntimeError, TimeoutError) as e:
            raise AssertionError(f"{e}; output:\n{self.output()[-4000:]}") from e

    def wait_for(self, pattern: str, timeout_s: float = 90.0, start: int = 0) -> re.Match[str]:
        """The first output line from ``start`` on that matches ``pattern``."""
        deadline = time.monotonic() + timeout_s
        with self._cv:
            while True:
                for line in self.lines[start:]:
                    if m := re.search(pattern, line):
                        return m
                if time.monotonic() > deadline or not self._reader.is_alive():
                    raise AssertionError(f"no line matching {pattern!r}; output:\n{self.output()[-4000:]}")
                self._cv.wait(0.5)

    def stop(self, timeout_s: float = 60.0) -> str:
        """Ctrl-C (SIGINT), wait for the exit (SIGKILL to the group after ``timeout_s``); the output."""
        if self.p.poll() is None:
            self.p.send_signal(signal.SIGINT)
        try:
            self.p.wait(timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(self.p.pid, signal.SIGKILL)
            self.p.wait()
        self._reader.join(10)
        return self.output()

    def __enter__(self) -> UpProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
