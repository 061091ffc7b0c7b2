"""No hang, ever (docs/faults.md): a failure on any rank ends every rank quickly, with one root cause.

The rows of an exception in one phase on one rank run lorakit's real training job in a 2-process group
started as plain processes, the way srun or pdsh start them (fault_harness_worker.py: one job per row, the
failure injected into that phase's work by tests/fault_injection.py). The rows that need the launcher (a
rank SIGKILLed mid-step, trackers that are down) are links of test_resume.py's chain of launches of
`python -m lorakit.run` (docs/faults.md's `killed`).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from lorakit.engine.launch import free_port, launch_env
from tests.conftest import ROOT
from tests.integration.fault_harness_worker import RANK0_WORK, ROWS
from tests.process_groups import finish_group, start_group

WORKER = Path(__file__).with_name("fault_harness_worker.py")


def _start_harness(args: list[str]) -> list[subprocess.Popen]:
    """The harness on 2 plain processes (RANK, WORLD_SIZE and the rendezvous in their environment), on the
    session's warm interpreter (PYTHON_EXEC, tests/conftest.py) when there is one: no row needs a fresh one."""
    port = str(free_port())
    python = os.environ.get("PYTHON_EXEC", sys.executable)
    procs = []
    for rank in (0, 1):
        env = {**launch_env(), "RANK": str(rank), "WORLD_SIZE": "2", "MASTER_ADDR": "127.0.0.1"}
        env.update(MASTER_PORT=port, LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE="2", PYTHONPATH=str(ROOT))
        procs.append(start_group([python, str(WORKER), *args], env, ROOT, merge_stderr=True))
    return procs


def _finish(
    procs: list[subprocess.Popen], timeout: float = 600
) -> list[tuple[subprocess.CompletedProcess, float]]:
    """Wait for every process (its group killed past `timeout`); each one's outputs and when it ended."""
    ended = {}

    def finish(p: subprocess.Popen) -> None:
        ended[p.pid] = (finish_group(p, timeout), time.time())

    threads = [threading.Thread(target=finish, args=(p,)) for p in procs]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return [ended[p.pid] for p in procs]


def _rows(out: Path, done: list[tuple[subprocess.CompletedProcess, float]]) -> list[list]:
    """What each rank of a harness launch wrote (its output when it wrote nothing)."""
    rows = [
        json.loads(p.read_text()) if p.exists() else [] for p in (out / "rank-0.json", out / "rank-1.json")
    ]
    for (d, _), r in zip(done, rows, strict=True):
        assert r, d.stdout[-5000:]
    return rows


@pytest.fixture(scope="module")
def harness(cache_dir, tmp_path_factory):
    """Both harness launches (rank 0 failing, rank 1 failing), at once; per launch: each rank's rows, the
    exit codes, and the seconds from the last row's failure until both processes were gone."""
    outs = {f: tmp_path_factory.mktemp(f"rank{f}-fails") for f in ROWS}
    procs = [p for f in ROWS for p in _start_harness([str(f), str(cache_dir), str(outs[f])])]
    done = _finish(procs)
    results = {}
    for f in ROWS:
        mine = done[2 * f : 2 * f + 2]
        gone = max(t for _, t in mine) - float((outs[f] / "step.failed-at").read_text())
        results[f] = (_rows(outs[f], mine), [d.returncode for d, _ in mine], gone)
    return results


# The phase label each row's error names (the step where the job does that work: 2 steps, a checkpoint
# after each, an evaluation after the last).
WHERE = {
    "load": "load",
    "prepare": "prepare",
    "tracker start": "tracker start",
    "eval write": "eval write at step 2",
    "checkpoint save": "checkpoint save at step 2",
    "checkpoint publish": "checkpoint save at step 2",
    "adapter save": "adapter save at step 2",
    "summary": "summary",
    "resume": "resume",
    "metrics write": "metrics write at step 1",
    "eval metrics": "eval metrics at step 2",
}
# The complete checkpoints the failure leaves (the newest is what a relaunch resumes from).
COMPLETE = {"eval write": [1], "checkpoint save": [1], "checkpoint publish": [1], "adapter save": [1, 2]}
COMPLETE["summary"] = [1, 2]
# A failed write of step 1's record stops every rank at step 2's closing all_reduce, after checkpoint 1.
COMPLETE |= {"metrics write": [1], "eval metrics": [1]}
AGREED = [(f, i) for f, rows in ROWS.items() for i in range(len(rows) - 1) if rows[i][0] != RANK0_WORK]


@pytest.mark.parametrize(("failing", "row"), AGREED, ids=[f"{ROWS[f][i][0]}-rank{f}" for f, i in AGREED])
def test_an_error_on_one_rank_stops_every_rank_at_the_agreement(harness, failing, row):
    (rank0, rank1), _, _ = harness[failing]
    phase = ROWS[failing][row][0]
    cause = f"rank {failing} failed during {WHERE[phase]}: RuntimeError: injected in {phase}"
    for rank, rows in ((0, rank0), (1, rank1)):
        got_phase, kind, message, took, after = rows[row]
        assert got_phase == phase and took < 60
        if rank == failing:
            # The failing rank raises its own error, the root cause.
            assert (kind, message) == ("RuntimeError", f"injected in {phase}")
        else:
            # The others learn it at the agreement: one line naming the rank, the phase, the step, the error.
            assert (kind, message) == ("RankFailedError", f"{cause}; rank {rank} stopped with it")
        # No rank was left in a collective: the group still works after the row.
        assert after["group"] == 2.0
    after = rank0[row][-1]
    # The launcher ends with the root cause, exit code 1; what was complete before stays complete, and a
    # failed save leaves nothing half-written behind.
    assert after["launcher"] == [cause, 1]
    complete = COMPLETE.get(phase, [])
    assert after["complete"] == complete
    assert after["entries"] == [f"step-{s:08d}" for s in complete]


def test_rank_1_does_none_of_rank_0s_work(harness):
    """Every piece of rank 0's own work (RANK0_PHASES) fails on rank 1, and the job completes."""
    (rank0, rank1), _, _ = harness[1]
    row = [r[0] for r in rank1].index(RANK0_WORK)
    assert rank0[row][1:4] == rank1[row][1:4] == ["ok", "", None]
    after = rank0[row][-1]
    assert after["launcher"] == ["no exit.json", None] and after["complete"] == [1, 2]


@pytest.mark.parametrize("failing", list(ROWS))
def test_an_error_in_a_step_ends_the_other_rank_with_the_phase_and_step(harness, failing):
    rows, codes, gone = harness[failing]
    other = 1 - failing
    # Both processes end within a minute of the failure, with the exit code of lorakit.run.
    assert codes == [1, 1] and gone < 60
    assert rows[failing][-1][:3] == ["step", "RuntimeError", "injected in step"]
    phase, kind, message, took, _ = rows[other][-1]
    assert (phase, kind) == ("step", "CollectiveTimeoutError") and took < 60
    assert message.startswith(
        f"rank {other} stopped during training at step 1: a collective did not complete"
    )
    assert rows[0][-1][-1]["launcher"] == [
        f"rank {failing} failed during training at step 1: RuntimeError: injected in step",
        1,
    ]


def test_a_failure_inside_deepspeeds_checkpoint_collectives_reaches_every_rank(cache_dir, tmp_path):
    """Review L4's fourth case, under plain processes (no launcher of lorakit's): rank 0 fails inside
    DeepSpeed's own checkpoint save while rank 1 waits in DeepSpeed's barrier, where lorakit's agreement
    cannot reach it (before dist.foreign_collectives both waited until the group's 10-minute timeout). Each
    rank ends at once with the root cause, the launcher with its line and exit code 1, and checkpoint 1
    stays the newest complete one."""
    # A launch of its own, after the others (sharing the CPUs with them would slow their rows' timings).
    done = _finish(_start_harness(["barrier", str(cache_dir), str(tmp_path)]), 300)
    rank0, rank1 = _rows(tmp_path, done)
    codes = [d.returncode for d, _ in done]
    gone = max(t for _, t in done) - float((tmp_path / "step.failed-at").read_text())
    cause = "rank 0 failed during checkpoint save at step 2: RuntimeError: injected in checkpoint barrier"
    assert codes == [1, 1] and gone < 60
    assert rank0[:2] == ["RuntimeError", "injected in checkpoint barrier"]
    assert rank1[:2] == ["RankFailedError", f"{cause}; rank 1 stopped with it"]
    assert rank0[2] < 30 and rank1[2] < 30
    assert rank0[3] == {"broken": True, "launcher": [cause, 1], "complete": [1]}
    assert rank1[3] == {"broken": True}


def test_a_stalled_rank_is_an_error_after_the_group_timeout(tmp_path):
    rank0, _ = _rows(tmp_path, _finish(_start_harness(["stall", str(tmp_path)]), 60))
    kind, message, took = rank0
    assert kind == "CollectiveTimeoutError"
    assert message.startswith("rank 0 stopped during training at step 1: a collective did not complete")
    assert "distributed.timeout_minutes" in message
    # The group's timeout is 3 s; rank 1 stalls for 6.
    assert 2.5 < took < 5.9
