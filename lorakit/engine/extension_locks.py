"""Stale locks in the torch extensions cache, found before a run waits on them forever.

torch builds a JIT extension (DeepSpeed's CPU ops, such as the shared-memory collectives a CPU run builds
as its process group starts) under TORCH_EXTENSIONS_DIR (default ~/.cache/torch_extensions/pyXY_ACC/NAME),
holding NAME/lock open while it builds (torch.utils.file_baton.FileBaton) and removing it after. A build
that was killed leaves the file behind, and every later build of NAME waits for it to vanish, silently and
forever. A lock that no live process holds open is such a leftover: it is safe to remove.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# Without /proc (or where another user's processes cannot be read) a lock counts as stale only when it is
# older than this: no extension build takes an hour.
UNCHECKED_STALE_SECONDS = 3600.0


def extensions_root() -> Path:
    """TORCH_EXTENSIONS_DIR, or torch's default build root (~/.cache/torch_extensions)."""
    configured = os.environ.get("TORCH_EXTENSIONS_DIR")
    if configured:
        return Path(configured)
    from torch.utils.cpp_extension import get_default_build_root

    return Path(get_default_build_root())


def stale_locks(root: Path | None = None) -> list[Path]:
    """The lock files under the torch extensions cache `root` (default: extensions_root()) that no live
    process holds: leftovers of killed builds, which would make the next build of that extension wait
    forever. Sorted; [] when there is no cache."""
    root = Path(root) if root is not None else extensions_root()
    if not root.is_dir():
        return []
    # TORCH_EXTENSIONS_DIR/NAME/lock, or the default root's pyXY_ACC/NAME/lock.
    locks = sorted({*root.glob("*/lock"), *root.glob("*/*/lock")})
    if not locks:
        return []
    held, complete = _open_files()
    now = time.time()
    stale = []
    for lock in locks:
        try:
            resolved = lock.resolve()
            age = now - lock.stat().st_mtime
        except OSError:
            continue  # released while we looked
        if resolved in held:
            continue
        if complete or age > UNCHECKED_STALE_SECONDS:
            stale.append(lock)
    return stale


def describe_stale_locks(paths: list[Path]) -> str:
    """One line naming the stale lock file(s) and how to remove them."""
    if not paths:
        return "no stale locks in the torch extensions cache"
    names = " ".join(str(p) for p in paths)
    return (
        f"stale torch extension build lock{'s' if len(paths) > 1 else ''} (left by a killed build; "
        f"the next build would wait on it forever): remove with `rm {names}`"
    )


def _open_files() -> tuple[set[Path], bool]:
    """Every file some process on this machine holds open, and whether every process could be read."""
    held: set[Path] = set()
    proc = Path("/proc")
    if not proc.is_dir():
        return held, False
    complete = True
    for pid in proc.iterdir():
        if not pid.name.isdigit():
            continue
        try:
            fds = list((pid / "fd").iterdir())
        except FileNotFoundError:
            continue  # the process ended
        except PermissionError:
            complete = False
            continue
        for fd in fds:
            try:
                held.add(Path(os.readlink(fd)))
            except OSError:
                continue
    return held, complete
