"""The state dir's disk made full (ENOSPC) on demand, for the journal-failure tests: a real 2 MiB
tmpfs when this process may mount one (root), else injected write errors on the same paths."""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from pagedkv.block_manager_svc import snapshot


def fd_path(fd: int) -> str:
    try:
        return os.readlink(f"/proc/self/fd/{fd}")
    except OSError:
        return ""


class FullDisk:
    """The state dir's disk as full (ENOSPC) while `full`: a real 2 MiB tmpfs filled by a filler
    file when this process may mount one, else journal writes and snapshot writes that raise."""

    def __init__(self, root: Path, monkeypatch: pytest.MonkeyPatch, real: bool) -> None:
        self.state_dir = root / "state"
        self.mount = root / "tmpfs" if real else None
        self.full = False
        if self.mount is not None:
            self.mount.mkdir()
            subprocess.run(["mount", "-t", "tmpfs", "-o", "size=2m", "tmpfs", str(self.mount)], check=True)
            self.state_dir = self.mount / "state"
            return
        real_write, real_snapshot = os.write, snapshot.write
        prefix = str(self.state_dir)

        def write(fd: int, data: bytes) -> int:
            if self.full and fd_path(fd).startswith(prefix):
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_write(fd, data)

        def write_snapshot(state_dir: Path, seq: int, payload: bytes, sync: bool = True) -> Path:
            if self.full:
                raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
            return real_snapshot(state_dir, seq, payload, sync)

        monkeypatch.setattr(os, "write", write)
        monkeypatch.setattr(snapshot, "write", write_snapshot)

    def fill(self) -> None:
        self.full = True
        if self.mount is not None:
            with open(self.mount / "filler", "wb", buffering=0) as f:
                for chunk in (65536, 4096, 1):
                    with contextlib.suppress(OSError):
                        while f.write(b"\0" * chunk):
                            pass

    def free(self) -> None:
        self.full = False
        if self.mount is not None:
            (self.mount / "filler").unlink()

    def close(self) -> None:
        if self.mount is not None:
            subprocess.run(["umount", "-l", str(self.mount)], check=False)


def can_mount() -> bool:
    return os.geteuid() == 0 and shutil.which("mount") is not None


def full_disk(
    request: pytest.FixtureRequest, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> Iterator[FullDisk]:
    """A FullDisk, real ("tmpfs") or injected by `request.param`."""
    real = request.param == "tmpfs"
    if real and not can_mount():
        pytest.skip("mounting a tmpfs needs root; the injected variant covers the same path")
    d = FullDisk(tmp_path, monkeypatch, real)
    yield d
    d.close()
