"""Stale torch extension build locks are found, and locks a live process holds are not."""

from __future__ import annotations

import os
import time

import pytest

from lorakit.api import check_extension_locks
from lorakit.engine.extension_locks import UNCHECKED_STALE_SECONDS, describe_stale_locks, stale_locks
from lorakit.errors import ExtensionLockError


def _lock(root, *parts):
    d = root.joinpath(*parts)
    d.mkdir(parents=True)
    (d / "lock").touch()
    return d / "lock"


def test_a_lock_nobody_holds_is_stale_and_a_held_one_is_not(tmp_path):
    left = _lock(tmp_path, "py311_cpu", "deepspeed_shm_comm")
    held = _lock(tmp_path, "py311_cpu", "cpu_adam")
    direct = _lock(tmp_path, "fused_adam")  # TORCH_EXTENSIONS_DIR/NAME/lock
    (tmp_path / "py311_cpu" / "cpu_adam" / "build.ninja").touch()
    fd = os.open(held, os.O_RDONLY)  # what torch's FileBaton does while it builds
    try:
        assert stale_locks(tmp_path) == sorted([left, direct])
    finally:
        os.close(fd)
    assert stale_locks(tmp_path) == sorted([left, held, direct])
    assert stale_locks(tmp_path / "missing") == []
    line = describe_stale_locks([left])
    assert "\n" not in line and line.endswith(f"remove with `rm {left}`")


def test_the_default_root_is_torch_extensions_dir_and_train_refuses_to_hang_on_it(tmp_path, monkeypatch):
    monkeypatch.setenv("TORCH_EXTENSIONS_DIR", str(tmp_path))
    check_extension_locks()
    lock = _lock(tmp_path, "deepspeed_shm_comm")
    assert stale_locks() == [lock]
    with pytest.raises(ExtensionLockError, match=f"rm {lock}"):
        check_extension_locks()


def test_without_proc_only_an_old_lock_is_stale(tmp_path, monkeypatch):
    import lorakit.engine.extension_locks as locks

    monkeypatch.setattr(locks, "_open_files", lambda: (set(), False))
    lock = _lock(tmp_path, "x")
    assert stale_locks(tmp_path) == []
    old = time.time() - UNCHECKED_STALE_SECONDS - 10
    os.utime(lock, (old, old))
    assert stale_locks(tmp_path) == [lock]
