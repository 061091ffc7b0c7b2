"""Disk space: how much a filesystem has free, and "no space left" turned into a DiskFullError that names
what was being written.

Writers fail on a full disk in different ways: Python's file objects raise OSError(ENOSPC), safetensors a
SafetensorError whose text says "No space left on device (os error 28)", and torch.save (DeepSpeed's
checkpoints) a RuntimeError from its zip writer that says nothing about space ("unexpected pos ..."). So a
failure counts as a full disk when the error says so anywhere in its chain, or when the filesystem it was
writing to is (nearly) full right after it failed.
"""

from __future__ import annotations

import contextlib
import errno
import os
import shutil
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from lorakit.errors import DiskFullError

_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
# datasets checks the space itself before some writes: "Not enough disk space. Needed: ...".
_FULL_TEXT = (
    "no space left on device",
    "disk quota exceeded",
    "os error 28",
    "os error 122",
    "not enough disk space",
)
# A writer that failed without saying why, on a filesystem with less than this free, failed for want of
# space: torch.save stops a few hundred bytes short of what it meant to write.
NEARLY_FULL_BYTES = 1 << 20


def existing_ancestor(path: Path) -> Path:
    """`path`, or its nearest ancestor that exists (where a directory to be created would live)."""
    path = Path(path)
    while not path.exists() and path != path.parent:
        path = path.parent
    return path


def free_bytes(path: str | Path) -> int:
    """Bytes an unprivileged process may still write on the filesystem holding `path` (or the ancestor
    it would be created in)."""
    st = os.statvfs(existing_ancestor(Path(path)))
    return st.f_bavail * st.f_frsize


def disk_full(error: BaseException, path: str | Path | None = None) -> bool:
    """Whether `error`, raised while writing under `path`, means the filesystem is full (or the quota used
    up): said by the error or one it was raised from, or seen on the filesystem just after."""
    seen: set[int] = set()
    e: BaseException | None = error
    while e is not None and id(e) not in seen:
        seen.add(id(e))
        if isinstance(e, DiskFullError):
            return True
        if isinstance(e, OSError) and e.errno in _FULL_ERRNOS:
            return True
        if any(text in str(e).lower() for text in _FULL_TEXT):
            return True
        e = e.__cause__ or e.__context__
    if path is None or not isinstance(error, OSError | RuntimeError):
        return False
    try:
        return free_bytes(path) < NEARLY_FULL_BYTES
    except OSError:
        return False


@contextlib.contextmanager
def writing(what: str, path: str | Path, cleanup: Callable[[], object] | None = None) -> Iterator[None]:
    """Write `what` (a phrase: "the adapter", "summary.json") to `path` in the block; a full disk there
    becomes a DiskFullError naming both, after `cleanup` (removing the partial output) has run. An inner
    DiskFullError is named again after this, outer, `what`: the user cares about the checkpoint, not about
    which of its files hit the limit."""
    try:
        yield
    except Exception as e:
        if not disk_full(e, path):
            raise
        if cleanup is not None:
            with contextlib.suppress(Exception):
                cleanup()
        raise DiskFullError(
            f"no space left on the device while writing {what} ({path}): it was not written, and what was "
            "complete before (the previous checkpoint, outputs) is intact. Free space on that filesystem "
            f"(now {_size(_free_or_none(path))} free) and run the same command again (a training run resumes "
            "from its last complete checkpoint)"
        ) from (e.__cause__ if isinstance(e, DiskFullError) and e.__cause__ is not None else e)


@contextlib.contextmanager
def new_directory(final: Path) -> Iterator[Path]:
    """Yield a private sibling of `final` to write into; when the block finishes, it replaces `final` in
    one rename. If the block raises, the sibling is deleted and `final` is as it was, so a directory under
    the final name is always complete (a process killed outright can leave a `.NAME.tmp-*` sibling)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        if final.exists():
            old = final.parent / f".{final.name}.old-{uuid.uuid4().hex[:8]}"
            os.rename(final, old)
            os.rename(tmp, final)
            shutil.rmtree(old, ignore_errors=True)
        else:
            os.rename(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _free_or_none(path: str | Path) -> int | None:
    try:
        return free_bytes(path)
    except OSError:
        return None


def _size(n: int | None) -> str:
    if n is None:
        return "unknown"
    from lorakit.units import format_bytes

    return format_bytes(n)
