"""Who holds a run lock (lorakit.runlock): the holder record its file holds, whether the processes it names
still run on this machine (a pid is a process only with its start time: pids are reused), whether a
handed-down token is the lock's (held_by_launcher), and a training run's watch on its lock (LockWatch)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

from lorakit.errors import RunLockedError

HEARTBEAT_SECONDS = 30.0
LOCK = "run.lock"
# The token of the lock a lorakit launcher holds for the workers it starts (their environment only).
ENV = "LORAKIT_RUN_LOCK"


@dataclass(frozen=True)
class Holder:
    """Who holds a run lock: what the lock file says."""

    token: str
    host: str
    pid: int
    started: str  # ISO 8601, UTC
    command: str
    heartbeat: float  # seconds since the epoch, renewed every heartbeat_every seconds (shown, never judged)
    heartbeat_every: float = HEARTBEAT_SECONDS
    # Heartbeats so far: another host judges the lock by watching this advance on its own clock.
    beats: int = 0
    # Identifies the process beyond its pid (pids are reused): its start time in clock ticks since boot.
    pid_start: int | None = None
    # Same host name in another PID namespace (another container) means another machine for pids.
    pid_namespace: str | None = None
    # Processes the holder started that write the run directory (torchrun's agent): alive means held.
    children: list[list[int | None]] = field(default_factory=list)

    def pulse(self) -> tuple[int, float]:
        """What changes with every heartbeat (the count, and the time an older lorakit renewed alone)."""
        return self.beats, self.heartbeat

    def describe(self, now: float | None = None) -> str:
        """`pid 123 on host gpu-7 since 2026-... (python -m lorakit.run x.yaml), heartbeat 12 s ago`."""
        age = (now if now is not None else time.time()) - self.heartbeat
        return (
            f"pid {self.pid} on host {self.host} since {self.started} ({self.command}), last heartbeat "
            f"{age:.0f} s ago"
        )


def this_host() -> str:
    """The host name lorakit records in locks."""
    return socket.gethostname()


def pid_namespace() -> str | None:
    """This process's PID namespace (Linux), or None: a pid means a process only within one."""
    try:
        return os.readlink("/proc/self/ns/pid")
    except OSError:
        return None


def process_start(pid: int) -> int | None:
    """The process's start time in clock ticks after boot (Linux), or None where /proc cannot tell."""
    try:
        with open(f"/proc/{pid}/stat") as f:
            # The command name (field 2) may hold spaces and parentheses: count from the last ")".
            return int(f.read().rsplit(")", 1)[1].split()[19])
    except (OSError, IndexError, ValueError):
        return None


def alive(pid: int | None, start: int | None) -> bool:
    """Whether process `pid` runs and is the one that started at `start` (when known), not a reuse of its
    pid."""
    if not pid:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's process: it exists
    now_start = process_start(pid)
    return start is None or now_start is None or now_start == start


def read_holder(path: Path, wait: float = 1.0) -> Holder | None:
    """The holder recorded in lock file `path`; None when there is no such file. A file without readable
    content (being written where hard links are not available, or damaged) is retried for `wait`
    seconds, then described as an unknown holder whose heartbeat is the file's modification time."""
    deadline = time.monotonic() + wait
    while True:
        try:
            text = path.read_text()
            mtime = path.stat().st_mtime
        except FileNotFoundError:
            return None
        try:
            raw = json.loads(text)
            return Holder(**{k: raw[k] for k in Holder.__dataclass_fields__ if k in raw})
        except (ValueError, TypeError, KeyError):
            if time.monotonic() >= deadline:
                return Holder("", "unknown", 0, "unknown", f"(unreadable lock file {path})", mtime)
            time.sleep(0.05)


@contextlib.contextmanager
def takeover_guard(run_dir: Path):
    """Hold an exclusive flock on the run directory while a stale lock is checked and removed; yields
    False where the filesystem cannot lock (then the caller takes the unguarded path). The kernel drops the
    flock when its process dies, so a takeover that was killed leaves nothing stale behind."""
    try:
        fd = os.open(run_dir, os.O_RDONLY)
    except OSError:
        yield False
        return
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
        except OSError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # closing the descriptor releases the flock


def held_by_launcher(environ: dict[str, str] | None = None, run_dir: str | Path | None = None) -> bool:
    """Whether this process is a worker of a lorakit launcher that holds the run lock for it. With
    `run_dir`, the handed-down token must be the one in its lock file: RunLockedError (exit 2) otherwise,
    so a stray LORAKIT_RUN_LOCK never lets a run write a directory it does not hold."""
    env = os.environ if environ is None else environ
    token = env.get(ENV)
    if not token:
        return False
    if run_dir is not None:
        path = Path(run_dir).expanduser().resolve() / LOCK
        holder = read_holder(path, wait=0.5)
        if holder is None or holder.token != token:
            held = holder.describe() if holder is not None else "nobody (there is no lock file)"
            raise RunLockedError(
                f"{ENV} in this process's environment says its launcher holds the run lock of {path.parent}, "
                f"but the lock is held by {held}; start the run with python -m lorakit.run (or unset {ENV})"
            )
    return True


class LockWatch:
    """Rank 0's eye on the run lock while training: `lost()` is True once run.lock no longer holds the
    token it held when the watch began (taken over, or removed), read at most every `every` seconds. The
    loop stops at the next step boundary with a checkpoint when it is (engine/session.py)."""

    def __init__(self, run_dir: str | Path, every: float = 1.0):
        self.path = Path(run_dir).expanduser().resolve() / LOCK
        holder = read_holder(self.path, wait=0.5)
        # No lock file: a job run without lorakit.train's lock (a test calling run_job): nothing to watch.
        self.token = holder.token if holder is not None else None
        self.every = every
        self._next = time.monotonic() + every
        self.lost_to: str | None = None

    def lost(self) -> bool:
        """Whether the lock was lost (cheap: reads the file at most every `every` seconds)."""
        if self.token is None or self.lost_to is not None:
            return self.lost_to is not None
        now = time.monotonic()
        if now < self._next:
            return False
        self._next = now + self.every
        current = read_holder(self.path, wait=0.2)
        if current is None or current.token != self.token:
            self.lost_to = current.describe() if current is not None else "nobody (it was removed)"
        return self.lost_to is not None


def in_use(run_dir: Path, holder: Holder) -> RunLockedError:
    """The error for a run directory whose lock `holder` holds."""
    return RunLockedError(
        f"output.dir {run_dir} is in use by another run: {holder.describe()}. Wait for it to finish or stop "
        f"it, or use another output.dir. (A run that was killed leaves the lock behind; it is taken over once "
        f"its process is gone, or from another host once its heartbeat is seen to stop.)"
    )


def refuse_if_held_here(run_dir: str | Path) -> None:
    """RunLockedError when a live process of this machine holds `run_dir`'s lock; reads, creates nothing.
    Lets a launch stop before preparing data; another host's lock is judged when the lock is taken."""
    if not Path(run_dir).is_dir():
        return  # nothing holds it; what is in the way is the preflight's to name
    holder = read_holder(Path(run_dir) / LOCK)
    if holder is not None and held_here(holder):
        raise in_use(Path(run_dir), holder)


def held_here(holder: Holder) -> bool | None:
    """Whether `holder`'s processes are alive, for a lock of this machine (same host and pid namespace);
    None for another machine's lock, which only its heartbeat can judge."""
    same_machine = holder.host == this_host() and (
        holder.pid_namespace is None or pid_namespace() is None or holder.pid_namespace == pid_namespace()
    )
    if not (same_machine and holder.pid):
        return None
    return any(alive(pid, start) for pid, start in [[holder.pid, holder.pid_start], *holder.children])
