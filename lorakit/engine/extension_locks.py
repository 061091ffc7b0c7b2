"""Stale build locks in the torch extensions cache.

DeepSpeed builds its C++/CUDA ops (cpu_adam, fused_adam, the shared-memory collectives on CPU) just in
time through torch.utils.cpp_extension, which serialises builds of one op with a file named `lock` in the
op's build directory (torch's FileBaton). A build that is killed (Ctrl-C, OOM, a preempted job) leaves the
file behind, and every later process that needs the op waits on it forever, silently, at start. A lock is
stale when it is older than STALE_AFTER_SECONDS and no live process is building in its directory.
"""

from __future__ import annotations

import os
import time
from pathlib import Path

# A real build of a DeepSpeed op takes one to a few minutes; a lock older than this with nobody building
# is left over from a killed one.
STALE_AFTER_SECONDS = 300
LOCK_NAME = "lock"


def extensions_root() -> Path:
    """Where torch builds extensions: TORCH_EXTENSIONS_DIR, else torch's default cache directory
    (~/.cache/torch_extensions, or under XDG_CACHE_HOME)."""
    env = os.environ.get("TORCH_EXTENSIONS_DIR")
    if env:
        return Path(env).expanduser()
    cache = os.environ.get("XDG_CACHE_HOME") or "~/.cache"
    return Path(cache).expanduser() / "torch_extensions"


def _building_dirs() -> list[Path]:
    """Working directories and command-line paths of live processes (where a build may be running)."""
    import psutil

    dirs: list[Path] = []
    for proc in psutil.process_iter():
        try:
            dirs.append(Path(proc.cwd()))
            dirs += [Path(arg) for arg in proc.cmdline() if arg.startswith("/")]
        except (psutil.Error, OSError, ValueError):
            continue
    return dirs


def _in_use(build_dir: Path, live: list[Path]) -> bool:
    return any(p == build_dir or build_dir in p.parents for p in live)


def stale_locks(root: Path | None = None) -> list[Path]:
    """The `lock` files under the extension build directories of `root` (default: extensions_root())
    that are older than STALE_AFTER_SECONDS while no live process works in their directory."""
    root = extensions_root() if root is None else Path(root)
    if not root.is_dir():
        return []
    # Build directories are ROOT/NAME (TORCH_EXTENSIONS_DIR) or ROOT/pyXY_cuZZ/NAME (the default).
    candidates = sorted({*root.glob(f"*/{LOCK_NAME}"), *root.glob(f"*/*/{LOCK_NAME}")})
    now = time.time()
    old = []
    for lock in candidates:
        try:
            age = now - lock.stat().st_mtime
        except OSError:  # removed by the build that held it, just now
            continue
        if age > STALE_AFTER_SECONDS:
            old.append(lock)
    if not old:
        return []
    live = _building_dirs()
    return [lock for lock in old if not _in_use(lock.parent, live)]


def describe_stale_locks(paths: list[Path]) -> str:
    """What the stale locks mean and what to do, in one paragraph ("" when there are none)."""
    if not paths:
        return ""
    listed = " ".join(str(p) for p in paths)
    return (
        f"{len(paths)} stale build lock(s) in the torch extensions cache: a build of a DeepSpeed op was "
        "killed and left its lock, so the next process that needs that op waits on it forever at start. "
        f"No process is building there now: remove them (rm {listed})"
    )
