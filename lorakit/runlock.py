"""One run directory, one writer: the run lock `OUTPUT_DIR/run.lock`.

The process the user started (`python -m lorakit.run`, or `lorakit.train` from Python) takes the lock before
any work and holds it until the job is over, merge included; the workers it starts through torchrun are
told (LORAKIT_RUN_LOCK in their environment) that their launcher holds it and take nothing. A job that a
foreign launcher started (torchrun, the deepspeed launcher: RANK set, no lorakit launcher above it) has no
process above its ranks that lorakit runs in, so its rank 0, the process that writes the run directory,
takes the lock for the job (lorakit.api).

The lock is a JSON file naming its holder (host, pid, start time, command) with a heartbeat count (and
time) that a background thread renews. It is created whole and atomically: written to a private file, then hard-linked
to `run.lock`, which fails if the name exists (on filesystems without hard links: O_CREAT|O_EXCL, and a
reader waits for the content). A second run into a held directory stops with RunLockedError (exit code 2)
naming the holder. A lock whose holder is gone is taken over with a message: on the same host (and PID
namespace) when none of its processes is alive; from another host (a shared filesystem) when its heartbeat
count is watched not to advance for `stale_after` seconds of this process's own clock (no two hosts' clocks
are compared). A takeover checks and removes the stale lock under an flock of the run
directory, so two processes racing for it never both win. Every exit but SIGKILL (finishing, an error,
preemption's exit 75) releases it. A training run that loses its lock stops at the next step boundary
with a checkpoint (LockWatch); merge and push take the lock too (holding_run_lock).
"""

from __future__ import annotations

import contextlib
import errno
import json
import os
import shlex
import sys
import threading
import time
import uuid
from dataclasses import asdict
from datetime import datetime, timezone
from pathlib import Path

from lorakit.errors import RunDirError, RunLockedError
from lorakit.lock_holder import (
    ENV,
    HEARTBEAT_SECONDS,
    LOCK,
    Holder,
    held_here,
    in_use,
    pid_namespace,
    process_start,
    read_holder,
    takeover_guard,
    this_host,
)
from lorakit.lock_holder import LockWatch as LockWatch
from lorakit.lock_holder import held_by_launcher as held_by_launcher
from lorakit.lock_holder import refuse_if_held_here as refuse_if_held_here

# How long another host's lock is watched, on this process's own monotonic clock, for its heartbeat count to
# advance: this many of the holder's heartbeat periods (plus a margin for a slow filesystem). No two clocks
# are compared, so skew between hosts never makes a live lock look stale.
STALE_AFTER_BEATS = 3
STALE_MARGIN_SECONDS = 10.0
_RETRY = ""
# What link(2) says on filesystems that have no hard links (some FUSE and SMB mounts).
_NO_HARD_LINKS = {errno.EPERM, errno.ENOTSUP, errno.EOPNOTSUPP, errno.EMLINK, errno.ENOSYS}


class RunLock:
    """The lock of one run directory, held by this process (see the module docstring).

    `acquire()` creates `run_dir` when needed (and `release()` removes what it created if the run left it
    empty, so input refused later leaves no directory behind); a context manager does both."""

    def __init__(
        self,
        run_dir: str | Path,
        *,
        heartbeat: float = HEARTBEAT_SECONDS,
        stale_after: float | None = None,
        command: str | None = None,
        say=None,
        claim: bool = False,
    ):
        self.run_dir = Path(run_dir).expanduser().resolve()
        self.path = self.run_dir / LOCK
        self.heartbeat = heartbeat
        # Seconds to watch another host's heartbeat (None: STALE_AFTER_BEATS of its periods + the margin).
        self.stale_after = stale_after
        # A training run's lock (lorakit.api): the directory must be one a run may write (rundir.check_trusted);
        # once held, it is marked as a run directory and what a crash left in it is recovered.
        self.claim = claim
        self.token = uuid.uuid4().hex
        # The command line that started this process, for whoever finds the directory locked.
        self.command = command if command is not None else shlex.join(getattr(sys, "orig_argv", sys.argv))
        self._say = say or (lambda line: print(line, flush=True))
        self._holder: Holder | None = None
        self._created: list[Path] = []
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._lock = threading.Lock()
        self.lost: Holder | None = None

    # --- taking and giving back ---------------------------------------------------------------------

    def acquire(self) -> RunLock:
        """Take the lock, taking over a stale one (with a message); RunLockedError when it is held.
        With `claim`: RunDirError, before anything is created, for a directory no run may write."""
        if self.claim:
            from lorakit import rundir

            found = rundir.check_trusted(self.run_dir)
        self._make_run_dir()
        try:
            for _ in range(10):
                if self._create():
                    self._start_heartbeat()
                    if self.claim:
                        self._claim(found)
                    return self
                holder = read_holder(self.path)
                if holder is None:
                    continue  # released meanwhile: try again
                stale = self.stale_reason(holder)
                if stale == _RETRY:
                    continue
                if stale is None:
                    raise in_use(self.run_dir, holder)
                if self._remove(holder):
                    self._say(f"run lock: taking over {self.path} from {holder.describe()}: {stale}")
            raise RunLockedError(
                f"output.dir {self.run_dir}: could not take the run lock {self.path}: other processes keep "
                "taking it at the same time"
            )
        except BaseException:
            self._remove_created()
            raise

    def release(self) -> None:
        """Stop the heartbeat and remove the lock if it is still this process's; idempotent."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        with self._lock:
            if self._holder is not None and self._owned():
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
            self._holder = None
        self._remove_created()

    def __enter__(self) -> RunLock:
        return self.acquire()

    def __exit__(self, *exc) -> None:
        self.release()

    def add_child(self, pid: int) -> None:
        """Record a process this one started that writes the run directory (torchrun): while it lives,
        the lock is held even if this process was killed outright."""
        with self._lock:
            if self._holder is None:
                return
            children = [*self._holder.children, [pid, process_start(pid)]]
            self._holder = Holder(**{**asdict(self._holder), "children": children})
            self._rewrite()

    def environment(self) -> dict[str, str]:
        """What the workers of this launcher get in their environment: they must not take the lock."""
        return {ENV: self.token}

    # --- who holds it ------------------------------------------------------------------------------

    def stale_reason(self, holder: Holder) -> str | None:
        """Why `holder`'s lock is stale (its processes are gone, its heartbeat stopped), None if it is held,
        or "" when the lock changed hands or went while it was watched (try again)."""
        here = held_here(holder)
        if here is None:
            return self._watch(holder)
        return None if here else f"its process {holder.pid} is gone"

    def _watch(self, holder: Holder) -> str | None:
        """Another host's lock: stale when its heartbeat count does not advance for the watch window,
        measured on this process's monotonic clock (the holder's timestamps are never compared with ours)."""
        window = self.stale_after
        if window is None:
            window = STALE_AFTER_BEATS * holder.heartbeat_every + STALE_MARGIN_SECONDS
        self._say(
            f"run lock: {self.path} is held from another host ({holder.describe()}); watching its heartbeat "
            f"for {window:.0f} s"
        )
        start = time.monotonic()
        while time.monotonic() - start < window:
            time.sleep(min(1.0, window / 10))
            now = read_holder(self.path, wait=0.2)
            if now is None or now.token != holder.token:
                return _RETRY
            if now.pulse() != holder.pulse():
                return None
        return (
            f"its heartbeat count stayed at {holder.beats} for {window:.0f} s (renewed every "
            f"{holder.heartbeat_every:.0f} s while held)"
        )

    # --- the file ----------------------------------------------------------------------------------

    def _make_run_dir(self) -> None:
        missing = []
        p = self.run_dir
        while not p.exists() and p != p.parent:
            missing.append(p)
            p = p.parent
        try:
            self.run_dir.mkdir(parents=True, exist_ok=True)
        except OSError as e:
            raise RunDirError(f"output.dir {self.run_dir} cannot be created: {e.strerror or e}") from e
        self._created = missing  # innermost first

    def _claim(self, found: str) -> None:
        from lorakit import rundir

        if found == "older":
            self._say(
                f"output.dir {self.run_dir}: a run directory of an earlier lorakit; marking it as lorakit's"
            )
        rundir.mark(self.run_dir)
        for line in rundir.recover(self.run_dir):
            self._say(f"output.dir {self.run_dir}: {line}")

    def _remove_created(self) -> None:
        from lorakit import rundir

        if self._created and [p.name for p in self._created[0].iterdir()] == [rundir.MARKER]:
            (self._created[0] / rundir.MARKER).unlink()  # the run wrote nothing but the mark
        for p in self._created:
            with contextlib.suppress(OSError):
                p.rmdir()  # only when empty: a run that wrote anything keeps its directory
        self._created = []

    def _new_holder(self) -> Holder:
        now = time.time()
        return Holder(
            token=self.token,
            host=this_host(),
            pid=os.getpid(),
            started=datetime.fromtimestamp(now, timezone.utc).strftime("%Y-%m-%d %H:%M:%S UTC"),
            command=self.command,
            heartbeat=now,
            heartbeat_every=self.heartbeat,
            pid_start=process_start(os.getpid()),
            pid_namespace=pid_namespace(),
        )

    def _create(self) -> bool:
        holder = self._new_holder()
        text = json.dumps(asdict(holder), indent=2) + "\n"
        tmp = self.run_dir / f".{LOCK}.{self.token}"
        try:
            tmp.write_text(text)
            try:
                # link(2) publishes the whole file under the name, or fails when the name exists.
                os.link(tmp, self.path)
            except FileExistsError:
                return False
            except OSError as e:
                if e.errno not in _NO_HARD_LINKS:
                    raise
                if not self._create_exclusive(text):
                    return False
        except OSError as e:
            raise RunDirError(f"output.dir {self.run_dir}: cannot write the run lock {self.path}: {e}") from e
        finally:
            with contextlib.suppress(OSError):
                tmp.unlink()
        self._holder = holder
        return True

    def _create_exclusive(self, text: str) -> bool:
        # Filesystems without hard links: O_EXCL creates the name atomically, the content follows (readers
        # wait for it, read_holder).
        try:
            fd = os.open(self.path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o644)
        except FileExistsError:
            return False
        with os.fdopen(fd, "w") as f:
            f.write(text)
            f.flush()
            os.fsync(f.fileno())
        return True

    def _owned(self) -> bool:
        current = read_holder(self.path, wait=0.2)
        return current is not None and self._holder is not None and current.token == self._holder.token

    def _rewrite(self) -> None:
        """Replace the lock's content (same token) in one rename, if the lock is still this process's."""
        if self._holder is None or not self._owned():
            if self._holder is not None and self.lost is None:
                self.lost = read_holder(self.path, wait=0.2)
                self._say(
                    f"warning: the run lock {self.path} was taken over by "
                    f"{self.lost.describe() if self.lost else 'nobody (it was removed)'}; another run may be "
                    "writing this directory"
                )
            return
        tmp = self.run_dir / f".{LOCK}.{self.token}.{uuid.uuid4().hex[:8]}"
        try:
            tmp.write_text(json.dumps(asdict(self._holder), indent=2) + "\n")
            os.replace(tmp, self.path)
        except OSError:
            # A full or briefly unavailable filesystem: the next heartbeat tries again.
            with contextlib.suppress(OSError):
                tmp.unlink()

    def _remove(self, holder: Holder) -> bool:
        """Remove `holder`'s stale lock, unless another process replaced it meanwhile."""
        with takeover_guard(self.run_dir) as guarded:
            if guarded:
                # Every takeover holds the guard, so the lock checked here is the one removed: a lock that a
                # faster process took over meanwhile (another token) is never touched.
                current = read_holder(self.path, wait=0.2)
                if current is None or current.token != holder.token:
                    return False
                with contextlib.suppress(FileNotFoundError):
                    self.path.unlink()
                return True
            return self._remove_unguarded(holder)

    def _remove_unguarded(self, holder: Holder) -> bool:
        # Where the filesystem has no flock: move the lock aside, then check whose it was. A live lock moved
        # aside by mistake is linked back, but a third process can take the free name in that moment.
        aside = self.run_dir / f".{LOCK}.stale-{uuid.uuid4().hex}"
        try:
            os.rename(self.path, aside)
        except FileNotFoundError:
            return False  # someone else removed it first
        moved = read_holder(aside, wait=0.2)
        if moved is not None and moved.token != holder.token:
            with contextlib.suppress(OSError):
                os.link(aside, self.path)
            with contextlib.suppress(OSError):
                aside.unlink()
            return False
        aside.unlink()
        return True

    def _start_heartbeat(self) -> None:
        self._stop.clear()
        self._thread = threading.Thread(target=self._beat, name="lorakit-run-lock", daemon=True)
        self._thread.start()

    def _beat(self) -> None:
        while not self._stop.wait(self.heartbeat):
            with self._lock:
                if self._holder is None or self.lost is not None:
                    return
                beat = {"heartbeat": time.time(), "beats": self._holder.beats + 1}
                self._holder = Holder(**{**asdict(self._holder), **beat})
                self._rewrite()


def holding_run_lock(merge_fn):
    """Decorate `merge_fn(source, output, ...)` so that, given a run directory (or RUN/adapter, RUN/model),
    it runs holding that run's lock: a merge never reads an adapter that a training run into the same
    directory is still writing, and a training run never starts under a merge. `lock=False`: the caller
    holds it already (output.merge, inside the training job)."""
    import functools

    from lorakit import rundir

    @functools.wraps(merge_fn)
    def wrapper(source, output, *args, lock: bool = True, **kwargs):
        p = Path(source).expanduser().resolve()
        run_dir = next((d for d in (p, p.parent) if (d / rundir.RECIPE).is_file()), None)
        if not lock or run_dir is None:
            return merge_fn(source, output, *args, **kwargs)
        held = RunLock(run_dir, say=lambda line: print(line, file=sys.stderr, flush=True))
        try:
            held.acquire()
        except RunDirError:
            # A run directory this process cannot write (a read-only copy) has no training run writing
            # into it from here either: merge it without the lock.
            return merge_fn(source, output, *args, **kwargs)
        try:
            return merge_fn(source, output, *args, **kwargs)
        finally:
            held.release()

    return wrapper
