"""The run lock: taken atomically, refused while held (naming the holder), taken over when stale (dead
process on this host, stopped heartbeat from another host), renewed, released, and exactly one winner
when several processes race for it."""

import json
import multiprocessing
import os
import subprocess
import sys
import threading
import time

import pytest

from lorakit import runlock
from lorakit.errors import RunLockedError
from lorakit.runlock import LOCK, RunLock, read_holder


def _lock_content(**fields):
    now = time.time()
    return {
        "token": "someone-else",
        "host": runlock.this_host(),
        "pid": os.getpid(),
        "started": "2026-01-01 00:00:00 UTC",
        "command": "python -m lorakit.run recipes/x.yaml",
        "heartbeat": now,
        "heartbeat_every": 30.0,
        **fields,
    }


def _lock_file(run_dir, **fields):
    """Write a lock file as another process would have, with `fields` over a plausible holder."""
    run_dir.mkdir(parents=True, exist_ok=True)
    content = _lock_content(**fields)
    (run_dir / LOCK).write_text(json.dumps(content))
    return content


def _dead_pid() -> int:
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    return proc.pid


def test_acquire_writes_the_holder_and_release_removes_it_and_the_directory_it_made(tmp_path):
    run_dir = tmp_path / "runs" / "x"
    lines = []
    with RunLock(run_dir, command="python -m lorakit.run x.yaml", say=lines.append) as lock:
        holder = read_holder(run_dir / LOCK)
        assert holder.token == lock.token and holder.pid == os.getpid()
        assert holder.host == runlock.this_host() and holder.command == "python -m lorakit.run x.yaml"
        assert abs(holder.heartbeat - time.time()) < 60
        assert [p.name for p in run_dir.iterdir()] == [LOCK]  # no temporary file left beside it
    # The run wrote nothing: the directories the lock created are gone again.
    assert not (tmp_path / "runs").exists() and lines == []


def test_release_keeps_a_directory_the_run_wrote_into(tmp_path):
    with RunLock(tmp_path / "run"):
        (tmp_path / "run" / "summary.json").write_text("{}")
    assert sorted(p.name for p in (tmp_path / "run").iterdir()) == ["summary.json"]


def test_a_held_lock_is_refused_naming_its_holder(tmp_path):
    with RunLock(tmp_path / "run", command="python -m lorakit.run first.yaml"):
        with pytest.raises(RunLockedError) as e:
            RunLock(tmp_path / "run").acquire()
    message = str(e.value)
    assert f"output.dir {tmp_path / 'run'} is in use by another run" in message
    assert f"pid {os.getpid()} on host {runlock.this_host()}" in message
    assert "python -m lorakit.run first.yaml" in message
    assert e.value.exit_code == 2 and e.value.doc_link() == "docs/resume.md#the-run-lock"


@pytest.mark.slow
def test_a_lock_whose_process_is_gone_is_taken_over_with_a_message(tmp_path):
    pid = _dead_pid()
    _lock_file(tmp_path / "run", pid=pid)
    lines = []
    with RunLock(tmp_path / "run", say=lines.append) as lock:
        assert read_holder(tmp_path / "run" / LOCK).token == lock.token
    assert len(lines) == 1
    assert f"taking over {tmp_path / 'run' / LOCK} from pid {pid}" in lines[0]
    assert f"its process {pid} is gone" in lines[0]


def test_a_reused_pid_does_not_keep_a_lock(tmp_path):
    # This process's pid, but recorded with another start time: the pid was reused after the holder died.
    start = runlock.process_start(os.getpid())
    if start is None:
        pytest.skip("no /proc: process start times are unknown here")
    _lock_file(tmp_path / "run", pid_start=start + 1)
    lines = []
    with RunLock(tmp_path / "run", say=lines.append) as lock:
        holder = read_holder(tmp_path / "run" / LOCK)
        assert holder.token == lock.token and holder.pid_start == start  # this process, its own start time
    assert len(lines) == 1 and f"its process {os.getpid()} is gone" in lines[0]
    assert not (tmp_path / "run" / LOCK).exists()


@pytest.mark.slow
def test_a_live_child_keeps_the_lock_of_a_dead_launcher(tmp_path):
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        _lock_file(
            tmp_path / "run", pid=_dead_pid(), children=[[child.pid, runlock.process_start(child.pid)]]
        )
        with pytest.raises(RunLockedError):
            RunLock(tmp_path / "run").acquire()
    finally:
        child.kill()
        child.wait()
    with RunLock(tmp_path / "run", say=lambda line: None):
        pass


def _beating(run_dir, stop, **fields):
    """Another host's live holder: its heartbeat count advances every 50 ms (its clock is its own)."""
    beats = 0
    while not stop.is_set():
        beats += 1
        tmp = run_dir / ".beat"
        tmp.write_text(json.dumps({**_lock_content(**fields), "beats": beats}))
        os.replace(tmp, run_dir / LOCK)
        time.sleep(0.05)


def _start_beating(run_dir, **fields):
    stop = threading.Event()
    beater = threading.Thread(target=_beating, args=(run_dir, stop), kwargs=fields)
    beater.start()
    while not (run_dir / LOCK).exists():
        time.sleep(0.01)
    return stop, beater


def test_another_hosts_lock_is_judged_by_its_heartbeat_count_never_by_comparing_clocks(tmp_path):
    run = tmp_path / "run"
    run.mkdir()
    # Its clock is an hour behind ours: a live holder all the same, because its count advances.
    stop, beater = _start_beating(run, host="gpu-node-7", pid=1, heartbeat=time.time() - 3600)
    try:
        with pytest.raises(RunLockedError, match="pid 1 on host gpu-node-7"):
            RunLock(run, stale_after=1.0, say=lambda line: None).acquire()
    finally:
        stop.set()
        beater.join()
    # Its clock is an hour ahead (a "fresh" timestamp) but the count stands still: taken over after the watch.
    _lock_file(run, host="gpu-node-7", pid=1, heartbeat=time.time() + 3600, beats=7)
    lines = []
    started = time.monotonic()
    with RunLock(run, stale_after=0.5, say=lines.append):
        pass
    assert time.monotonic() - started >= 0.5
    assert "is held from another host" in lines[0] and "watching its heartbeat" in lines[0]
    assert "taking over" in lines[-1] and "its heartbeat count stayed at 7" in lines[-1]


@pytest.mark.slow
def test_same_host_name_in_another_pid_namespace_counts_as_another_host(tmp_path):
    # A container with the same host name: its pids mean nothing here, only its heartbeat does.
    if runlock.pid_namespace() in (None, "pid:[1]"):
        pytest.skip("PID namespaces are not visible here")
    (tmp_path / "run").mkdir()
    stop, beater = _start_beating(tmp_path / "run", pid=_dead_pid(), pid_namespace="pid:[1]")
    try:
        with pytest.raises(RunLockedError):
            RunLock(tmp_path / "run", stale_after=1.0, say=lambda line: None).acquire()
    finally:
        stop.set()
        beater.join()


def test_the_heartbeat_is_renewed_and_a_lost_lock_is_noticed(tmp_path):
    lines = []
    lock = RunLock(tmp_path / "run", heartbeat=0.1, say=lines.append).acquire()
    try:
        first = read_holder(lock.path).heartbeat
        deadline = time.time() + 20
        while read_holder(lock.path).heartbeat == first and time.time() < deadline:
            time.sleep(0.05)
        assert read_holder(lock.path).heartbeat > first
        assert read_holder(lock.path).token == lock.token
        # Someone took it over (its heartbeat looked stopped from their host): this holder notices and no
        # longer writes or removes it.
        _lock_file(tmp_path / "run", host="elsewhere", token="usurper")
        deadline = time.time() + 20
        while lock.lost is None and time.time() < deadline:
            time.sleep(0.05)
        assert lock.lost is not None and lock.lost.token == "usurper"
        assert "was taken over by" in lines[-1]
    finally:
        lock.release()
    assert read_holder(tmp_path / "run" / LOCK).token == "usurper"


def test_an_unreadable_lock_is_held_while_it_changes_and_taken_over_when_it_stands_still(tmp_path):
    (tmp_path / "run").mkdir()
    lock_file = tmp_path / "run" / LOCK
    lock_file.write_text("")  # being written where hard links are not available
    stop = threading.Event()

    def touching():
        while not stop.is_set():
            t = time.time() + 0.05
            os.utime(lock_file, (t, t))
            time.sleep(0.05)

    toucher = threading.Thread(target=touching)
    toucher.start()
    try:
        with pytest.raises(RunLockedError, match="unreadable lock file"):
            RunLock(tmp_path / "run", stale_after=1.0, say=lambda line: None).acquire()
    finally:
        stop.set()
        toucher.join()
    with RunLock(tmp_path / "run", stale_after=0.3, say=lambda line: None):
        pass


def test_without_hard_links_the_lock_is_created_exclusively(tmp_path, monkeypatch):
    def no_links(src, dst):
        raise OSError(1, "Operation not permitted")

    monkeypatch.setattr(os, "link", no_links)
    with RunLock(tmp_path / "run") as lock:
        assert read_holder(lock.path).token == lock.token
        with pytest.raises(RunLockedError):
            RunLock(tmp_path / "run").acquire()


def _race(run_dir, stale: bool, start, results):
    start.wait()
    try:
        lock = RunLock(run_dir, say=lambda line: None).acquire()
    except RunLockedError:
        results.put("refused")
        return
    results.put("took")
    time.sleep(2)  # hold it while the others try
    lock.release()


@pytest.mark.slow
@pytest.mark.parametrize("stale", [False, True], ids=["free", "stale"])
def test_of_racing_processes_exactly_one_takes_the_lock(tmp_path, stale):
    if stale:
        _lock_file(tmp_path / "run", pid=_dead_pid())
    ctx = multiprocessing.get_context("fork")
    start, results = ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(tmp_path / "run", stale, start, results)) for _ in range(6)]
    for p in procs:
        p.start()
    start.set()
    outcomes = sorted(results.get(timeout=60) for _ in procs)
    for p in procs:
        p.join(timeout=60)
    assert outcomes == ["refused"] * 5 + ["took"]
    assert not (tmp_path / "run" / LOCK).exists()


def test_workers_of_a_lorakit_launcher_see_its_token():
    lock = RunLock("unused")
    env = lock.environment()
    assert runlock.held_by_launcher(env) and not runlock.held_by_launcher({})


def test_a_handed_down_token_must_be_the_locks_own(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        assert runlock.held_by_launcher(lock.environment(), tmp_path / "run")
        # A stray or stale LORAKIT_RUN_LOCK does not let a process write a directory someone else holds.
        with pytest.raises(RunLockedError, match=f"held by pid {os.getpid()}"):
            runlock.held_by_launcher({runlock.ENV: "not-the-token"}, tmp_path / "run")
    with pytest.raises(RunLockedError, match="there is no lock file"):
        runlock.held_by_launcher(lock.environment(), tmp_path / "run")


def test_a_lost_lock_is_seen_by_the_training_runs_watch(tmp_path):
    with RunLock(tmp_path / "run") as lock:
        watch = runlock.LockWatch(tmp_path / "run", every=0.0)
        assert watch.token == lock.token and not watch.lost()
        _lock_file(tmp_path / "run", host="elsewhere", token="usurper")
        assert watch.lost() and "host elsewhere" in watch.lost_to
    # A job run without a lock (no lock file) has nothing to watch.
    assert not runlock.LockWatch(tmp_path / "other", every=0.0).lost()


@pytest.mark.slow
def test_a_takeover_that_read_a_stale_holder_late_never_lets_a_third_process_in(tmp_path, monkeypatch):
    # The interleaving behind two winners of a race for a stale lock: B reads the stale holder; A takes it
    # over and holds the lock; B, acting on what it read, must not move A's lock aside, because a third
    # process C would find the name free in that moment and take it too.
    run_dir = tmp_path / "run"
    stale = _lock_file(run_dir, pid=_dead_pid(), token="stale")
    late_view = runlock.Holder(**stale)
    a = RunLock(run_dir, say=lambda line: None).acquire()
    real_read, real_rename = runlock.read_holder, os.rename
    views = iter([late_view])
    monkeypatch.setattr(
        runlock, "read_holder", lambda path, wait=1.0: next(views, None) or real_read(path, wait)
    )
    third = []

    def rename_then_third_tries(src, dst):
        real_rename(src, dst)
        if str(src) == str(run_dir / LOCK) and not third:
            try:
                third.append(RunLock(run_dir, say=lambda line: None).acquire())
            except RunLockedError:
                third.append("refused")

    monkeypatch.setattr(os, "rename", rename_then_third_tries)
    with pytest.raises(RunLockedError, match="in use by another run"):
        RunLock(run_dir, say=lambda line: None).acquire()
    assert all(t == "refused" for t in third)
    assert read_holder(run_dir / LOCK).token == a.token
    a.release()


@pytest.mark.slow
def test_where_the_filesystem_cannot_flock_a_stale_lock_is_still_taken_over(tmp_path, monkeypatch):
    import fcntl

    def no_flock(fd, op):
        raise OSError(37, "No locks available")

    monkeypatch.setattr(fcntl, "flock", no_flock)
    _lock_file(tmp_path / "run", pid=_dead_pid())
    lines = []
    with RunLock(tmp_path / "run", say=lines.append) as lock:
        assert read_holder(lock.path).token == lock.token
    assert any("taking over" in line for line in lines)
