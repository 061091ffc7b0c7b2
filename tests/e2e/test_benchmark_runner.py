"""benchmarks/harness/runner.py's Runner: a worker's result, its failure and its time limit, with the worker
started as a new interpreter (measured runs) and forked from the preloaded server, tests/docs/zygote.py
(--smoke runs)."""

import json
import os
import time
from pathlib import Path

import pytest

from benchmarks.harness.runner import Runner
from tests.conftest import ROOT

# A benchmark script with three workers: one answers, one fails, one outlives its time with a child of its own.
SCRIPT = f"""
import subprocess, sys, time
sys.path.insert(0, {str(ROOT)!r})
from benchmarks.harness.runner import worker_main

def answer(spec):
    print("answering", spec["n"])
    return {{"double": 2 * spec["n"]}}

def fail(spec):
    print("giving up")
    sys.exit(3)

def hang(spec):
    child = subprocess.Popen(["sleep", "60"])
    open(spec["pid_file"], "w").write(str(child.pid))
    time.sleep(60)

if __name__ == "__main__":
    sys.exit(worker_main({{"answer": answer, "fail": fail, "hang": hang}}, sys.argv[1:]))
"""


def gone(pid: int) -> bool:
    """No such process, or only its exit status left (a zombie nobody has reaped yet)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().split(")")[-1].split()[0] == "Z"
    except FileNotFoundError:
        return True


@pytest.mark.parametrize("forked", [False, True], ids=["new-interpreter", "forked"])
def test_runner_returns_results_reports_failures_and_kills_what_outlives_its_budget(tmp_path, forked):
    script = tmp_path / "bench.py"
    script.write_text(SCRIPT)
    log = tmp_path / "workers.log"
    # Nothing to preload: the harness's own imports are what this script needs.
    runner = Runner(script, tmp_path, log, budget=60, forked=forked, preload=[])
    assert (runner.zygote is not None) == forked

    result = runner.run("answer", {"n": 21}, "first")
    assert result["double"] == 42 and result["process_seconds"] > 0
    assert "===== first (answer)" in log.read_text() and "answering 21" in log.read_text()

    with pytest.raises(RuntimeError, match="second run failed: exit code 3") as failed:
        runner.run("fail", {}, "second")
    assert "giving up" in str(failed.value)

    pid_file = tmp_path / "pid"
    start = time.monotonic()
    with pytest.raises(RuntimeError, match="third run failed: timed out after"):
        runner.run("hang", {"pid_file": str(pid_file)}, "third", reserve=runner.remaining() - 2)
    assert time.monotonic() - start < 30
    # The worker's own session went with it: its child too.
    deadline = time.monotonic() + 10
    while not gone(int(pid_file.read_text())) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert gone(int(pid_file.read_text()))
    assert json.loads((tmp_path / "first.result.json").read_text()) == {"double": 42}
    assert os.environ.get("PYTHONWARNINGS") != "ignore"  # the workers' variables stayed theirs
    if forked:  # the three ran in children of the server, none in a new interpreter
        runner.zygote.close()
        assert "fresh interpreter" not in (tmp_path / "zygote.log").read_text()
