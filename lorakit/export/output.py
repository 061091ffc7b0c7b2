"""The export directory: written whole beside its final name and renamed into place, or not at all."""

from __future__ import annotations

import contextlib
import os
import re
import shutil
import uuid
from collections.abc import Iterator
from pathlib import Path

from lorakit import disclosure, storage
from lorakit.errors import DiskFullError, MergeError

_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12}
_UNITS.update({"KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40})


def parse_size(text: str | int) -> int:
    """`5GB`, `500MB`, `100KiB` or a byte count -> bytes (KB/MB/GB are powers of 1000, as on the hub)."""
    if isinstance(text, int) and not isinstance(text, bool):
        size = text
    else:
        m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", str(text))
        unit = m.group(2).upper() if m else None
        if m is None or unit not in _UNITS:
            raise MergeError(
                f"--max-shard-size {text!r}: expected a size such as 5GB, 500MB or 100KiB",
                doc="docs/merge.md#options",
            )
        size = int(float(m.group(1)) * _UNITS[unit])
    if size < 1:
        raise MergeError(f"--max-shard-size {text!r}: must be at least 1 byte", doc="docs/merge.md#options")
    return size


def check_output(output: Path, force: bool, protect: list[Path]) -> Path:
    """The resolved output path, refused when it would overwrite something it must not.

    An existing non-empty directory (or a file) is replaced only with force; never the directory being
    merged or one that contains it (force would delete the adapter being read)."""
    output = Path(output).expanduser().resolve()
    for p in protect:
        p = p.resolve()
        if output == p or output in p.parents:
            raise MergeError(
                f"--output {output}: would overwrite {p}, which the merge reads; choose another",
                doc="docs/merge.md#atomic-output",
            )
    if output.is_dir() and any(output.iterdir()) and not force:
        raise MergeError(
            f"--output {output} exists and is not empty; choose another or pass --force",
            doc="docs/merge.md#atomic-output",
        )
    if output.exists() and not output.is_dir() and not force:
        raise MergeError(
            f"--output {output} exists and is a file; choose another or pass --force",
            doc="docs/merge.md#atomic-output",
        )
    return output


@contextlib.contextmanager
def atomic_directory(output: Path, force: bool) -> Iterator[Path]:
    """Yield a private sibling directory of `output`; when the block finishes, rename it to `output`.

    If the block raises (KeyboardInterrupt included), the sibling is deleted and `output` is untouched, as are
    any parent directories this created; a full disk is a DiskFullError (exit code 74). A process killed outright (SIGKILL) can leave a `.NAME.tmp-*`
    sibling, never a directory under the final name."""
    missing = [p for p in [output.parent, *output.parent.parents] if not p.exists()]
    output.parent.mkdir(parents=True, exist_ok=True)
    tmp = output.parent / f".{output.name}{storage.TMP_MARK}{os.getpid()}-{uuid.uuid4().hex[:8]}"
    tmp.mkdir()
    try:
        yield tmp
        for f in tmp.rglob("*"):
            # As readable as the user's umask makes any new file, no more (some writers make theirs 0600).
            os.chmod(f, disclosure.file_mode(directory=f.is_dir()))
        _publish(tmp, output, force)
    except BaseException as e:
        # Judged before the partial export is deleted: that frees the space that ran out.
        full = isinstance(e, Exception) and storage.disk_full(e, tmp)
        shutil.rmtree(tmp, ignore_errors=True)
        for p in missing:  # innermost first; only ones still empty
            with contextlib.suppress(OSError):
                p.rmdir()
        if full:
            raise DiskFullError(
                f"no space left on the device while writing the merged model ({output}): nothing was written "
                "there (the partial export was deleted). Free space on that filesystem, or choose an --output "
                "on another one, and merge again (with output.merge: relaunch the training command, which "
                "resumes from its last checkpoint and merges)",
                doc="docs/merge.md#atomic-output",
            ) from e
        raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)


def _publish(tmp: Path, output: Path, force: bool) -> None:
    if output.exists() and not (output.is_dir() and not any(output.iterdir())):
        if not force:
            raise MergeError(f"--output {output} appeared while merging; nothing was written over it")
        # The old export (or the file --force replaces) stays under the final name until the new one is
        # complete and swapped in.
        storage.replace_directory(tmp, output)
        return
    # rename(2) replaces an empty directory atomically.
    storage.publish_directory(tmp, output)
