"""Who holds a run lock (lorakit.runlock): the holder record its file holds, and whether the processes it
names still run on this machine (a pid is a process only with its start time: pids are reused)."""

from __future__ import annotations

import json
import os
import socket
import time
from dataclasses import dataclass, field
from pathlib import Path

HEARTBEAT_SECONDS = 30.0


@dataclass(frozen=True)
class Holder:
    """Who holds a run lock: what the lock file says."""

    token: str
    host: str
    pid: int
    started: str  # ISO 8601, UTC
    command: str
    heartbeat: float  # seconds since the epoch, renewed every heartbeat_every seconds
    heartbeat_every: float = HEARTBEAT_SECONDS
    # Identifies the process beyond its pid (pids are reused): its start time in clock ticks since boot.
    pid_start: int | None = None
    # Same host name in another PID namespace (another container) means another machine for pids.
    pid_namespace: str | None = None
    # Processes the holder started that write the run directory (torchrun's agent): alive means held.
    children: list[list[int | None]] = field(default_factory=list)

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
