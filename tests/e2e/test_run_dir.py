"""The run directory's guards through the real commands (recipes/quickstart.yaml: 2 processes, ZeRO-3):
an output.dir that is a file, read-only or full stops with exit code 2 naming the path, within seconds and
before any tokenizing, model building or torchrun; a locked output.dir is refused naming its holder, by
`python -m lorakit.run` and by every rank of a job that torchrun started directly."""

import os
import subprocess
import sys
import time

import pytest

from lorakit.engine.launch import free_port
from lorakit.runlock import LOCK, RunLock
from tests.conftest import RECIPES, ROOT
from tests.integration.test_resume import FAULTS

# Far below what even a refused run costs once it tokenizes or starts torchrun (the 2-process quickstart
# takes a minute here), and far above the imports a refusal needs (a few seconds) on a loaded 2-core machine.
FAST = 60


def _run(*overrides, fault: str | None = None) -> tuple[subprocess.CompletedProcess, float]:
    env = {k: v for k, v in os.environ.items() if k != "LORAKIT_FAULT"}
    if fault:
        env |= {"LORAKIT_FAULT": fault, "PYTHONPATH": os.pathsep.join([str(FAULTS), str(ROOT)])}
    start = time.monotonic()
    proc = subprocess.run(
        [sys.executable, "-m", "lorakit.run", str(RECIPES / "quickstart.yaml"), *map(str, overrides)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    return proc, time.monotonic() - start


def _assert_refused_before_any_work(proc, seconds: float, cache) -> None:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr
    # No tokenizing (it prints "data: ...") or batching line, no tiny model built, no tokenized data cached.
    assert "data:" not in proc.stdout and "batching:" not in proc.stdout
    assert not cache.exists()
    assert seconds < FAST, seconds


@pytest.mark.parametrize("case", ["a file", "read-only", "full"])
def test_an_output_dir_that_cannot_take_the_run_is_refused_at_once(case, tmp_path):
    cache, fault = tmp_path / "cache", None
    if case == "a file":
        out = tmp_path / "run"
        out.write_text("my notes\n")
        message = f"error: output.dir {out} exists and is not a directory"
    elif case == "read-only":
        out = tmp_path / "ro" / "run"
        out.mkdir(parents=True)
        fault = f"readonly:{tmp_path}/ro*"
        message = f"error: output.dir: {out} is not writable: it is on a read-only filesystem"
    else:
        out = tmp_path / "run"
        fault = f"disk-full:{tmp_path}*"
        message = f"error: not enough free space: output.dir {out} needs about"
    proc, seconds = _run(f"output.dir={out}", f"data.cache_dir={cache}", fault=fault)
    assert message in proc.stderr, proc.stderr[-3000:]
    assert proc.stderr.rstrip().endswith("see docs/resume.md#checks-before-the-run")
    _assert_refused_before_any_work(proc, seconds, cache)
    if case == "a file":
        assert out.read_text() == "my notes\n"
    else:
        assert [p.name for p in out.parent.iterdir()] == ([out.name] if case == "read-only" else [])
        assert not out.exists() or list(out.iterdir()) == []


def test_a_locked_output_dir_is_refused_naming_the_holder(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    with RunLock(out, command="python -m lorakit.run recipes/quickstart.yaml"):
        proc, seconds = _run(f"output.dir={out}", f"data.cache_dir={cache}")
        assert f"error: output.dir {out} is in use by another run: pid {os.getpid()} on host" in proc.stderr
        assert "(python -m lorakit.run recipes/quickstart.yaml)" in proc.stderr
        assert proc.stderr.rstrip().endswith("see docs/resume.md#the-run-lock")
        _assert_refused_before_any_work(proc, seconds, cache)
        assert [p.name for p in out.iterdir()] == [LOCK]


@pytest.mark.slow
def test_a_job_torchrun_started_directly_is_refused_on_every_rank(tmp_path):
    """No lorakit launcher: rank 0 checks and takes the lock and tells the other rank, so both exit 2
    (neither waits for the other) and torchrun fails."""
    cache, out = tmp_path / "cache", tmp_path / "run"
    with RunLock(out, command="the first job"):
        start = time.monotonic()
        proc = subprocess.run(
            [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--nproc_per_node=2",
                "--master_addr=127.0.0.1",
                f"--master_port={free_port()}",
                "-m",
                "lorakit.run",
                str(RECIPES / "quickstart.yaml"),
                f"output.dir={out}",
                f"data.cache_dir={cache}",
            ],
            cwd=ROOT,
            env={**os.environ, "OMP_NUM_THREADS": "1"},
            capture_output=True,
            text=True,
            timeout=600,
        )
        seconds = time.monotonic() - start
    output = proc.stdout + proc.stderr
    assert proc.returncode != 0
    # Both ranks print the refusal and exit 2.
    assert output.count(f"error: output.dir {out} is in use by another run") == 2, output[-4000:]
    assert output.count("exitcode  : 2") >= 1, output[-4000:]
    assert not cache.exists() and seconds < 2 * FAST


def test_the_recipe_file_on_the_command_line_is_never_written_to(tmp_path):
    """`python -m lorakit.run RUN/recipe.yaml KEY=VALUE`: the resolved dump would replace the file the user
    gave; it is refused (exit 2) before training, the file as it was. Unchanged (the same resolved recipe),
    the file is not rewritten either."""
    from tests.conftest import run_cli

    run = tmp_path / "run"
    run.mkdir()
    recipe = run / "recipe.yaml"
    text = (RECIPES / "quickstart.yaml").read_text() + "\n# mine\n"
    recipe.write_text(text)
    out = run_cli("lorakit.run", recipe, f"output.dir={run}", "train.max_steps=1")
    assert out.returncode == 2, out.stderr[-3000:]
    assert "is the run's recipe.yaml" in out.stderr and "Traceback" not in out.stderr
    assert recipe.read_text() == text and sorted(p.name for p in run.iterdir()) == ["recipe.yaml"]
