"""Disk faults for tests: a full filesystem, a read-only one, and writes that run out of space, each for
the paths matching a glob (fnmatch on the path as a string; `*` crosses `/`).

- `disk-full`: os.statvfs reports no free space for matching paths; nothing else changes (what a run's
  checks before it starts read).
- `readonly`: creating or writing a matching file or directory fails with EROFS, as on a read-only mount.
- `enospc`: a write to a matching file stops part-way, as each writer does on a full disk: Python's file
  objects raise OSError(ENOSPC) after writing part of the data (a partial file stays), torch.save a
  RuntimeError from its zip writer that says nothing about space (also after a partial file), safetensors'
  save_file a SafetensorError whose text says "No space left on device (os error 28)". From then on
  os.statvfs reports this process's filesystems full, as they would be.

Installed in every process of a launch by tests/integration/faults/sitecustomize.py (LORAKIT_FAULT=enospc:GLOB,
disk-full:GLOB, readonly:GLOB), before any library binds the functions, or in this process with `installed`.
"""

from __future__ import annotations

import builtins
import contextlib
import errno
import fnmatch
import io
import os

KINDS = ("disk-full", "readonly", "enospc")
_WRITE_FLAGS = os.O_WRONLY | os.O_RDWR | os.O_CREAT | os.O_APPEND | os.O_TRUNC


def _writing(mode: str) -> bool:
    return any(c in mode for c in "wax+")


class _FullFile:
    """A file object whose first write stores half of its data and then fails as a full disk does."""

    def __init__(self, f, faults: DiskFaults):
        self._f, self._faults = f, faults

    def write(self, data):
        self._f.write(data[: len(data) // 2])
        self._f.flush()
        self._faults.full = True
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), getattr(self._f, "name", None))

    def __getattr__(self, name):
        return getattr(self._f, name)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self._f.close()

    def __iter__(self):
        return iter(self._f)


class DiskFaults:
    """One fault (`kind`, see the module docstring) for the paths matching `pattern`."""

    def __init__(self, kind: str, pattern: str):
        if kind not in KINDS:
            raise ValueError(f"disk fault {kind!r}: one of {KINDS}")
        self.kind, self.pattern = kind, pattern
        # enospc: a write failed, so the filesystem now reads as full.
        self.full = False
        self.fired = 0
        self._fds: set[int] = set()
        self._saved: list[tuple[object, str, object]] = []

    def matches(self, path) -> bool:
        try:
            return fnmatch.fnmatch(os.fsdecode(os.fspath(path)), self.pattern)
        except TypeError:  # a file descriptor or a buffer, not a path
            return False

    def _patch(self, owner, name: str, new) -> None:
        self._saved.append((owner, name, getattr(owner, name)))
        setattr(owner, name, new)

    def install(self) -> DiskFaults:
        """Apply the fault to this process (until `uninstall`)."""
        real_statvfs, real_open, real_os_open, real_mkdir, real_fdopen = (
            os.statvfs,
            builtins.open,
            os.open,
            os.mkdir,
            os.fdopen,
        )

        def statvfs(path):
            st = real_statvfs(path)
            if (self.kind == "disk-full" and self.matches(path)) or self.full:
                fields = list(st)
                fields[3] = fields[4] = 0  # f_bfree, f_bavail
                return os.statvfs_result(fields)
            return st

        self._patch(os, "statvfs", statvfs)
        if self.kind == "disk-full":
            return self

        def refuse(path):
            self.fired += 1
            raise OSError(errno.EROFS, os.strerror(errno.EROFS), os.fsdecode(os.fspath(path)))

        def open_(file, mode="r", *args, **kwargs):
            if _writing(mode) and self.matches(file):
                if self.kind == "readonly":
                    refuse(file)
                self.fired += 1
                return _FullFile(real_open(file, mode, *args, **kwargs), self)
            return real_open(file, mode, *args, **kwargs)

        def os_open(path, flags, *args, **kwargs):
            if flags & _WRITE_FLAGS and self.matches(path):
                if self.kind == "readonly":
                    refuse(path)
                fd = real_os_open(path, flags, *args, **kwargs)
                self._fds.add(fd)
                return fd
            return real_os_open(path, flags, *args, **kwargs)

        def fdopen(fd, *args, **kwargs):
            f = real_fdopen(fd, *args, **kwargs)
            if fd in self._fds:
                self._fds.discard(fd)
                self.fired += 1
                return _FullFile(f, self)
            return f

        def mkdir(path, *args, **kwargs):
            if self.kind == "readonly" and self.matches(path):
                refuse(path)
            return real_mkdir(path, *args, **kwargs)

        self._patch(builtins, "open", open_)
        self._patch(io, "open", open_)
        self._patch(os, "open", os_open)
        self._patch(os, "fdopen", fdopen)
        self._patch(os, "mkdir", mkdir)
        if self.kind == "enospc":
            self._patch_tensor_writers()
        return self

    def _patch_tensor_writers(self) -> None:
        import safetensors
        import safetensors.torch
        import torch

        real_save, real_save_file = torch.save, safetensors.torch.save_file

        def save(obj, f, *args, **kwargs):
            if not self.matches(f):
                return real_save(obj, f, *args, **kwargs)
            buffer = io.BytesIO()
            real_save(obj, buffer, *args, **kwargs)
            data = buffer.getvalue()
            with open(f, "wb") as out:  # the real open: `open` here is this module's global
                out.write(data[: len(data) // 2])
            self.full, self.fired = True, self.fired + 1
            raise RuntimeError(
                f"[enforce fail at inline_container.cc:672] . unexpected pos {len(data) // 2} vs {len(data)}"
            )

        def save_file(tensors, filename, *args, **kwargs):
            if not self.matches(filename):
                return real_save_file(tensors, filename, *args, **kwargs)
            self.full, self.fired = True, self.fired + 1
            raise safetensors.SafetensorError(
                "Error while serializing: I/O error: No space left on device (os error 28)"
            )

        self._patch(torch, "save", save)
        self._patch(safetensors.torch, "save_file", save_file)

    def uninstall(self) -> None:
        """Undo `install`."""
        for owner, name, original in reversed(self._saved):
            setattr(owner, name, original)
        self._saved.clear()


_REAL_OPEN = builtins.open


def open(file, mode="r", *args, **kwargs):
    """The unpatched open, for the fault's own writes."""
    return _REAL_OPEN(file, mode, *args, **kwargs)


@contextlib.contextmanager
def installed(kind: str, pattern: str):
    """The fault applied to this process for the duration of the block; yields the DiskFaults."""
    faults = DiskFaults(kind, pattern).install()
    try:
        yield faults
    finally:
        faults.uninstall()
