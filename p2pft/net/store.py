"""A durable voter's data directory: its Raft hard state in one file, replaced atomically.

``VoterStore`` holds ``<data dir>/voter.state`` (msgpack of ``HardState.to_wire``) and a lock
file. ``save`` writes a temporary file, fsyncs it, renames it over the old one and fsyncs the
directory, so a crash at any moment leaves either the old state or the new one, never a torn
one; the driver calls it before it sends the messages of the step that changed the state
(etcd's rule: p2pft/core/durable.py). The lock (``flock``) keeps a second process from using
the same directory: two processes with one voter identity could vote twice in a term.
"""
from __future__ import annotations

import errno
import fcntl
import os
from pathlib import Path

import msgpack

from ..core.durable import HardState

STATE_FILE = "voter.state"
LOCK_FILE = "lock"


class DataDirError(RuntimeError):
    """The data directory cannot be used (in use, unreadable, not a voter state): one line saying why."""


class VoterStore:
    """One node's data directory, locked for the life of the process (``close`` releases it)."""

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        try:
            self.path.mkdir(parents=True, exist_ok=True)
            self._lock_fd: int | None = os.open(self.path / LOCK_FILE, os.O_RDWR | os.O_CREAT, 0o644)
        except OSError as exc:
            raise DataDirError(f"cannot use data directory {self.path}: {exc.strerror or exc}") from None
        try:
            fcntl.flock(self._lock_fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as exc:
            os.close(self._lock_fd)
            self._lock_fd = None
            if exc.errno in (errno.EAGAIN, errno.EACCES):
                raise DataDirError(f"data directory {self.path} is in use by another process (two processes "
                                   "must never share a voter identity)") from None
            raise DataDirError(f"cannot lock data directory {self.path}: {exc.strerror or exc}") from None
        self.writes = 0

    @property
    def file(self) -> Path:
        return self.path / STATE_FILE

    def load(self) -> HardState | None:
        """The saved state, or None for a directory that holds none (a first start)."""
        try:
            data = self.file.read_bytes()
        except FileNotFoundError:
            return None
        except OSError as exc:
            raise DataDirError(f"cannot read {self.file}: {exc.strerror or exc}") from None
        try:
            return HardState.from_wire(msgpack.unpackb(data, raw=False, strict_map_key=False))
        except (ValueError, msgpack.UnpackException) as exc:
            raise DataDirError(f"{self.file} is not a voter state this version wrote ({exc}); move it away to "
                               "start as a new voter identity") from None

    def save(self, hs: HardState) -> None:
        """Atomically replace the saved state (temp file, fsync, rename, fsync of the directory)."""
        data = msgpack.packb(hs.to_wire(), use_bin_type=True)
        tmp = self.path / (STATE_FILE + ".tmp")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            view = memoryview(data)
            while view:
                view = view[os.write(fd, view):]
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, self.file)
        dfd = os.open(self.path, os.O_RDONLY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)
        self.writes += 1

    def close(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)   # releases the flock
            self._lock_fd = None


__all__ = ["DataDirError", "LOCK_FILE", "STATE_FILE", "VoterStore"]
