"""Background checkpoints that never stall a step and never leave a half-written file behind.

Checkpoints matter only when every replica is lost at once; the rest of the time recovery comes
from peers. So writing must cost the training loop nothing: `save_async` hands a snapshot (CPU
copies from `state.capture`) to one writer thread and returns. If the writer is still busy, a
newer request replaces the queued one, since only the newest state is worth writing.

File format (no pickle, so loading a file cannot run code):
    b"P2PFTCK1" | u64 header length | msgpack header | padding to 64 | tensor bytes (each padded to
    64) | blake2b-256 of everything before
The header holds the step, the meta and, per tensor, its name, dtype, shape and byte length.
A file is written to a temporary name, fsynced, then renamed, so a crash leaves either the old
or the new file; a file that fails its digest anyway (disk fault, manual truncation) is skipped
with a warning and the next older one is used.
"""
from __future__ import annotations

import hashlib
import logging
import os
import re
import struct
import threading
from pathlib import Path
from typing import Any

import msgpack
import torch

log = logging.getLogger(__name__)

MAGIC = b"P2PFTCK1"
_ALIGN = 64
_DIGEST = 32
_NAME = re.compile(r"^ckpt-(\d{12})\.p2ck$")
_MAX_HEADER = 1 << 30

Checkpoint = tuple[int, dict[str, Any], dict[str, torch.Tensor]]


class CorruptCheckpointError(ValueError):
    """A checkpoint file is truncated, altered or not a checkpoint at all."""


def _dtype_from_name(name: str) -> torch.dtype:
    dtype = getattr(torch, name.removeprefix("torch."), None)
    if not isinstance(dtype, torch.dtype):
        raise CorruptCheckpointError(f"unknown dtype {name!r}")
    return dtype


def _pad(n: int) -> int:
    return -n % _ALIGN


def write_checkpoint(path: str | os.PathLike[str], step: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
    """Write one checkpoint file atomically (temp file, fsync, rename, fsync of the directory)."""
    path = Path(path)
    entries = []
    flats: list[torch.Tensor] = []
    for name, t in tensors.items():
        flat = t.detach().reshape(-1).contiguous()
        if flat.device.type != "cpu":
            flat = flat.cpu()
        flats.append(flat)
        entries.append([name, str(t.dtype), list(t.shape), flat.numel() * flat.element_size()])
    header = msgpack.packb({"step": step, "meta": meta, "tensors": entries}, use_bin_type=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.{threading.get_ident()}.tmp")
    h = hashlib.blake2b(digest_size=_DIGEST)
    try:
        with open(tmp, "wb") as f:

            def put(data: bytes | memoryview) -> None:
                f.write(data)
                h.update(data)

            put(MAGIC)
            put(struct.pack("<Q", len(header)))
            put(header)
            put(bytes(_pad(len(MAGIC) + 8 + len(header))))
            for flat in flats:
                if flat.numel():
                    put(memoryview(flat.view(torch.uint8).numpy()))
                put(bytes(_pad(flat.numel() * flat.element_size())))
            f.write(h.digest())
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def read_checkpoint(path: str | os.PathLike[str]) -> Checkpoint:
    """Read and verify one checkpoint file; raises CorruptCheckpointError if it does not verify."""
    path = Path(path)
    with open(path, "rb") as f:
        size = os.fstat(f.fileno()).st_size
        data = bytearray(size)
        if f.readinto(data) != size:
            raise CorruptCheckpointError("file changed size while being read")
    fixed = len(MAGIC) + 8
    if size < fixed + _DIGEST or data[: len(MAGIC)] != MAGIC:
        raise CorruptCheckpointError("not a checkpoint file (bad magic or too short)")
    if hashlib.blake2b(memoryview(data)[:-_DIGEST], digest_size=_DIGEST).digest() != data[-_DIGEST:]:
        raise CorruptCheckpointError("digest mismatch (truncated or altered)")
    (header_len,) = struct.unpack_from("<Q", data, len(MAGIC))
    if header_len > min(_MAX_HEADER, size - fixed - _DIGEST):
        raise CorruptCheckpointError(f"header length {header_len} does not fit the file")
    try:
        header = msgpack.unpackb(bytes(data[fixed:fixed + header_len]), raw=False)
        step, meta, entries = header["step"], header["meta"], header["tensors"]
    except Exception as exc:  # the digest passed, so this is a writer bug or a foreign file
        raise CorruptCheckpointError(f"unreadable header: {exc}") from None
    offset = fixed + header_len
    offset += _pad(offset)
    tensors: dict[str, torch.Tensor] = {}
    try:
        for name, dtype_name, shape, nbytes in entries:
            dtype = _dtype_from_name(dtype_name)
            if offset + nbytes > size - _DIGEST:
                raise CorruptCheckpointError(f"tensor {name!r} runs past the end of the file")
            if nbytes:
                t = torch.frombuffer(data, dtype=torch.uint8, count=nbytes, offset=offset).view(dtype)
                tensors[name] = t.view(shape)
            else:
                tensors[name] = torch.empty(shape, dtype=dtype)
            offset += nbytes + _pad(nbytes)
    except (TypeError, ValueError, RuntimeError) as exc:
        if isinstance(exc, CorruptCheckpointError):
            raise
        raise CorruptCheckpointError(f"bad tensor table: {exc}") from None
    return step, meta, tensors


class AsyncCheckpointer:
    """Writes snapshots in a background thread; at most one in flight and one queued.

    Give each replica its own directory: on start, temporary files left there by a writer that
    died are removed.
    """

    def __init__(self, directory: str | os.PathLike[str], keep: int = 2) -> None:
        if isinstance(keep, bool) or not isinstance(keep, int) or keep < 1:
            raise ValueError(f"keep must be a positive int, got {keep!r}")
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.keep = keep
        self.last_error: BaseException | None = None
        self._cond = threading.Condition()
        self._pending: Checkpoint | None = None
        self._busy = False
        self._closed = False
        for stale in self.directory.glob(".ckpt-*.tmp"):  # left by a process that died mid-write
            stale.unlink(missing_ok=True)
        self._thread = threading.Thread(target=self._run, name="p2pft-checkpoint", daemon=True)
        self._thread.start()

    def path_for(self, step: int) -> Path:
        return self.directory / f"ckpt-{step:012d}.p2ck"

    def save_async(self, step: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        """Queue a checkpoint and return at once; the tensors must not change until written."""
        if isinstance(step, bool) or not isinstance(step, int) or not 0 <= step < 10**12:
            raise ValueError(f"step must be an int in [0, 10**12), got {step!r}")
        if not isinstance(meta, dict):
            raise ValueError(f"meta must be a dict, got {type(meta).__name__}")
        try:
            msgpack.packb(meta, use_bin_type=True)
        except (TypeError, ValueError, OverflowError) as exc:
            raise ValueError(f"meta is not msgpack-able: {exc}") from None
        for name, t in tensors.items():
            if not isinstance(name, str) or not isinstance(t, torch.Tensor):
                raise ValueError(f"tensors must map str to torch.Tensor, got {name!r}: {type(t).__name__}")
        with self._cond:
            if self._closed:
                raise RuntimeError("save_async() on a closed AsyncCheckpointer")
            if self._pending is not None:
                log.debug("checkpoint of step %d replaced by step %d before it was written", self._pending[0], step)
            self._pending = (step, meta, dict(tensors))
            self._cond.notify_all()

    def _run(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._pending is not None or self._closed)
                if self._pending is None:
                    return
                job, self._pending = self._pending, None
                self._busy = True
            try:
                self._write_file(self.path_for(job[0]), *job)
                self._prune()
                log.info("checkpoint of step %d written to %s", job[0], self.path_for(job[0]))
            except Exception as exc:  # a full disk must not kill training; the next save retries
                self.last_error = exc
                log.exception("checkpoint of step %d failed", job[0])
            finally:
                with self._cond:
                    self._busy = False
                    self._cond.notify_all()

    def _write_file(self, path: Path, step: int, meta: dict[str, Any], tensors: dict[str, torch.Tensor]) -> None:
        write_checkpoint(path, step, meta, tensors)

    def steps(self) -> list[int]:
        """Steps of the checkpoint files present, oldest first (not verified)."""
        found = []
        for entry in self.directory.iterdir():
            m = _NAME.match(entry.name)
            if m:
                found.append(int(m.group(1)))
        return sorted(found)

    def _prune(self) -> None:
        for step in self.steps()[: -self.keep]:
            self.path_for(step).unlink(missing_ok=True)

    def latest(self) -> Checkpoint | None:
        """The newest checkpoint that verifies, or None; damaged files are skipped with a warning."""
        for step in reversed(self.steps()):
            path = self.path_for(step)
            try:
                got = read_checkpoint(path)
            except (CorruptCheckpointError, OSError) as exc:
                log.warning("ignoring checkpoint %s: %s", path, exc)
                continue
            if got[0] != step:
                log.warning("ignoring checkpoint %s: it holds step %s", path, got[0])
                continue
            return got
        return None

    def wait(self, timeout: float | None = None) -> bool:
        """Block until nothing is queued or being written; False if `timeout` ran out first."""
        with self._cond:
            return self._cond.wait_for(lambda: self._pending is None and not self._busy, timeout)

    def close(self, timeout: float | None = None) -> None:
        """Finish the queued write, then stop the writer thread."""
        with self._cond:
            self._closed = True
            self._cond.notify_all()
        self._thread.join(timeout)

    def __enter__(self) -> AsyncCheckpointer:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
