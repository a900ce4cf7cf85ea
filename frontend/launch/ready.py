"""`pagedkv up --ready-file PATH`: a machine-readable "everything is up", for scripts and tests.

Why a file and not a line of output: output is for people and may change wording; a program that
starts the stack needs to know when it can send requests, and where. The file is written once every
service answers its health check (atomically: a reader never sees half of it) and removed when
`up` stops, so its presence means "serving now"; it holds each service's name, address and pid
and, with a frontend, the OpenAI base URL.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import time
from dataclasses import asdict, dataclass


@dataclass(slots=True, frozen=True)
class ReadyService:
    name: str
    address: str
    pid: int


@dataclass(slots=True, frozen=True)
class StackReady:
    """What a ready stack tells its starter."""

    services: tuple[ReadyService, ...]
    url: str  # the OpenAI-compatible frontend's base URL (http[s]://host:port), "" with --no-serve
    state_dir: str  # the block manager's journal and snapshots

    def address(self, name: str) -> str:
        return self.service(name).address

    def service(self, name: str) -> ReadyService:
        for s in self.services:
            if s.name == name:
                return s
        raise KeyError(f"no service {name!r} in the stack (has {[s.name for s in self.services]})")

    @property
    def workers(self) -> list[str]:
        """The workers' addresses, in order (``--workers`` of `pagedkv generate`)."""
        return [s.address for s in self.services if s.name.startswith("worker-")]

    def write(self, path: str | pathlib.Path) -> None:
        """Atomically: a reader sees the whole file or none."""
        path = pathlib.Path(path)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        tmp.write_text(json.dumps(asdict(self), indent=1) + "\n")
        os.replace(tmp, path)

    @classmethod
    def read(cls, path: str | pathlib.Path) -> StackReady:
        raw = json.loads(pathlib.Path(path).read_text())
        return cls(
            services=tuple(ReadyService(**s) for s in raw["services"]),
            url=raw["url"],
            state_dir=raw["state_dir"],
        )


def wait_ready_file(
    path: str | pathlib.Path, proc: subprocess.Popen[str] | subprocess.Popen[bytes], timeout_s: float
) -> StackReady:
    """The ready file of the `pagedkv up` running as ``proc``, once written. RuntimeError when
    ``proc`` exits first, TimeoutError after ``timeout_s``."""
    path = pathlib.Path(path)
    deadline = time.monotonic() + timeout_s
    while not path.exists():
        if proc.poll() is not None:
            raise RuntimeError(f"pagedkv up exited with code {proc.returncode} before it was ready")
        if time.monotonic() > deadline:
            raise TimeoutError(f"pagedkv up was not ready within {timeout_s:g} s ({path} not written)")
        time.sleep(0.1)
    return StackReady.read(path)
