"""Disk space and durable writes: how much a filesystem has free, "no space left" turned into a DiskFullError
that names what was being written, and the one way lorakit writes a file or replaces a directory (temp ->
fsync -> rename -> fsync of the parent; see write_file and replace_directory).

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
import tempfile
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path

from lorakit import disclosure
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
    """Yield a private sibling of `final` to write into; when the block finishes, its files are fsynced and
    it replaces `final` (replace_directory). If the block raises, the sibling is deleted and `final` is as
    it was, so a directory under the final name is always complete (a process killed outright can leave a
    `.NAME.tmp-*` sibling, which recover_directory removes)."""
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".{final.name}{TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        replace_directory(tmp, final)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


# --- durable writes: temp -> fsync -> rename -> fsync of the parent ----------------------------------------

# Siblings a directory replacement leaves while it runs: the new one being written, the old one moved aside.
TMP_MARK = ".tmp-"
OLD_MARK = ".old-"
# renameat2(2)'s flag that swaps two names in one step (Linux 3.15+, most local filesystems).
_RENAME_EXCHANGE = 2
_AT_FDCWD = -100


def fsync_file(path: str | Path) -> None:
    """Flush one file's content to the disk."""
    with open(path, "rb") as f:
        os.fsync(f.fileno())


def fsync_dir(path: str | Path) -> None:
    """Flush a directory's entries (names created, renamed or removed in it) to the disk."""
    fd = os.open(path, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | Path) -> None:
    """fsync every file under `path`, then every directory, deepest first: a rename that publishes the
    tree must not reach the disk before what it publishes."""
    path = Path(path)
    dirs = [path]
    for p in sorted(path.rglob("*")):
        if p.is_symlink():
            continue
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            fsync_file(p)
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(d)


def write_file(path: str | Path, data: bytes | str, mode: int | None = None) -> None:
    """Write `data` to `path` durably and atomically: a temp file beside it, fsynced, renamed over `path`,
    then the directory fsynced. A reader (or a machine after a power loss) sees the old file or the new
    one, never a short one. `mode`: the file's permissions (mkstemp makes it private; default: what the
    user's umask gives a new file)."""
    path = Path(path)
    fd, tmp = tempfile.mkstemp(prefix=f".{path.name}-", dir=path.parent)
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data.encode() if isinstance(data, str) else data)
            f.flush()
            os.fsync(f.fileno())
        os.chmod(tmp, disclosure.file_mode() if mode is None else mode)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    fsync_dir(path.parent)


def publish_directory(tmp: Path, final: Path) -> None:
    """Durably rename the complete directory `tmp` to the new name `final`, which must not exist as a
    non-empty directory."""
    fsync_tree(tmp)
    os.rename(tmp, final)
    fsync_dir(final.parent)


def replace_directory(tmp: Path, final: Path) -> None:
    """Put the complete directory `tmp` (a sibling of `final`) in place of `final` (a directory, or a
    file), durably, with no moment
    where neither exists: its files are fsynced, then the two names are swapped in one renameat2 exchange
    and the old one (now under the temp name) is deleted. Where the filesystem cannot exchange, the old one
    is renamed aside (`.NAME.old-*`) first; a crash between the two renames is undone by
    recover_directory, which the next run of the directory calls."""
    if not final.exists():
        publish_directory(tmp, final)
        return
    fsync_tree(tmp)
    if _exchange(tmp, final):
        fsync_dir(final.parent)
        _remove(tmp)  # the old one, now under the temp name
        return
    old = final.parent / f".{final.name}{OLD_MARK}{uuid.uuid4().hex[:8]}"
    os.rename(final, old)
    try:
        os.rename(tmp, final)
    except BaseException:
        os.rename(old, final)
        raise
    fsync_dir(final.parent)
    _remove(old)


def _remove(path: Path) -> None:
    # What a replacement displaced: a directory, or a file where --force replaced one.
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        path.unlink(missing_ok=True)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names `a` and `b` atomically (renameat2 RENAME_EXCHANGE); False where this system or
    filesystem cannot."""
    import ctypes

    try:
        libc = ctypes.CDLL(None, use_errno=True)
        renameat2 = libc.renameat2
    except (OSError, AttributeError):
        return False
    renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    done = renameat2(_AT_FDCWD, os.fsencode(a), _AT_FDCWD, os.fsencode(b), _RENAME_EXCHANGE)
    if done == 0:
        return True
    err = ctypes.get_errno()
    if err in (errno.EINVAL, errno.ENOSYS, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EPERM):
        return False
    raise OSError(err, os.strerror(err), str(b))


def recover_directory(final: Path) -> list[str]:
    """Undo what a crash during replace_directory(_, final) left: the old directory renamed aside with no
    new one under the final name is put back; other `.NAME.old-*` and `.NAME.tmp-*` siblings are deleted.
    Only for a writer that holds the run lock (no one else is replacing `final`). Returns what it did, one
    phrase each, for the log."""
    done: list[str] = []
    parent = final.parent
    if not parent.is_dir():
        return done
    olds = sorted(parent.glob(f".{final.name}{OLD_MARK}*"), key=lambda p: p.stat().st_mtime)
    if olds and not final.exists():
        os.rename(olds.pop(), final)
        fsync_dir(parent)
        done.append(f"restored {final.name}/ from an interrupted replacement")
    for leftover in [*olds, *parent.glob(f".{final.name}{TMP_MARK}*")]:
        shutil.rmtree(leftover, ignore_errors=True)
        done.append(f"removed {leftover.name}, left by an interrupted write")
    return done


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
