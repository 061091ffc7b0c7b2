"""Commands started in a process group of their own, so that a test can kill "the node" (a launcher,
the torchrun it starts and its workers) without touching pytest, and a run that hangs past its timeout
never outlives the test."""

from __future__ import annotations

import os
import signal
import subprocess
from pathlib import Path


def start_group(
    cmd: list[str], env: dict[str, str], cwd: Path, *, merge_stderr: bool = False
) -> subprocess.Popen:
    """Start `cmd` as the leader of a new session; stderr piped apart, or into stdout with merge_stderr."""
    return subprocess.Popen(
        cmd,
        cwd=cwd,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT if merge_stderr else subprocess.PIPE,
        text=True,
        start_new_session=True,
    )


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL the process group of `proc` if its leader is still running, and reap the leader."""
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()


def finish_group(proc: subprocess.Popen, timeout: float) -> subprocess.CompletedProcess:
    """Wait for `proc` and return its outputs; past `timeout` (or on any error) its whole group is killed."""
    try:
        out, err = proc.communicate(timeout=timeout)
    finally:
        kill_group(proc)
    return subprocess.CompletedProcess(proc.args, proc.returncode, out, err)
