"""The workers' environment: glibc's mmap threshold fixed (flat memory from step to step), the user's
values kept."""

from lorakit.engine.launch import MALLOC_MMAP_THRESHOLD, launch_env


def test_the_mmap_threshold_is_fixed_unless_the_user_set_one(monkeypatch):
    monkeypatch.delenv("MALLOC_MMAP_THRESHOLD_", raising=False)
    assert launch_env()["MALLOC_MMAP_THRESHOLD_"] == str(MALLOC_MMAP_THRESHOLD) == "131072"
    monkeypatch.setenv("MALLOC_MMAP_THRESHOLD_", "4096")
    monkeypatch.setenv("OMP_NUM_THREADS", "2")
    env = launch_env()
    assert env["MALLOC_MMAP_THRESHOLD_"] == "4096" and env["OMP_NUM_THREADS"] == "2"
