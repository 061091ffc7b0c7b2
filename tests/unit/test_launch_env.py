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


def test_onednn_primitive_caches_are_capped_unless_the_user_set_them(monkeypatch):
    # Without a cap, each new matmul shape of a bf16 CPU run (rows of varying length) adds ~0.25 MB to
    # oneDNN's and ideep's caches of up to 1024 entries each: ~10 MB a step per rank at FLAN-T5-XL width.
    from lorakit.engine.launch import ONEDNN_CACHE_CAPACITY

    for name in ("ONEDNN_PRIMITIVE_CACHE_CAPACITY", "LRU_CACHE_CAPACITY"):
        monkeypatch.delenv(name, raising=False)
    env = launch_env()
    assert env["ONEDNN_PRIMITIVE_CACHE_CAPACITY"] == env["LRU_CACHE_CAPACITY"] == str(ONEDNN_CACHE_CAPACITY)
    assert 0 < ONEDNN_CACHE_CAPACITY < 1024
    monkeypatch.setenv("LRU_CACHE_CAPACITY", "1024")
    assert launch_env()["LRU_CACHE_CAPACITY"] == "1024"


def test_torchrun_runs_on_the_interpreter_it_starts_ranks_with(monkeypatch):
    # torchrun starts its ranks with PYTHON_EXEC when set; lorakit starts torchrun itself with the same one.
    import sys

    from lorakit.engine.launch import torchrun_command

    monkeypatch.delenv("PYTHON_EXEC", raising=False)
    assert torchrun_command(2, "lorakit.run", ["r.yaml"])[0] == sys.executable
    monkeypatch.setenv("PYTHON_EXEC", "/opt/py/bin/python3")
    cmd = torchrun_command(2, "lorakit.run", ["r.yaml", "--worker"])
    assert cmd[:3] == ["/opt/py/bin/python3", "-m", "torch.distributed.run"]
    assert cmd[-4:] == ["-m", "lorakit.run", "r.yaml", "--worker"]
