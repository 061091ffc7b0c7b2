"""A relaunch loses nothing (issue 44): a finished run relaunched with a failure injected after the model
loads (tests/fault_injection.py, phase `tracker start`: open_run_dir) leaves the previous adapter, merged
model and best weights byte for byte as they were; a run whose lock is taken over mid-training stops at the
next step boundary with a checkpoint (exit 75), and its `resume: never` moved the earlier checkpoints aside
instead of deleting them. One tiny 1-process run, in this process."""

from __future__ import annotations

import hashlib
import json
import time
from pathlib import Path

import pytest

import lorakit
from lorakit import rundir
from lorakit.engine import branches
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.engine.loop import Preempted
from lorakit.errors import RunDirError
from lorakit.recipe import recipe_from_dict
from lorakit.runlock import LOCK
from tests.conftest import tiny_recipe_dict
from tests.fault_injection import inject


def _tree(path: Path) -> dict[str, str]:
    return {
        p.relative_to(path).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(path.rglob("*"))
        if p.is_file()
    }


def _recipe(cache_dir: Path, run: Path, eval_every: int = 2, **train):
    raw = tiny_recipe_dict(
        cache_dir,
        run,
        train={"max_steps": 2, **train},
        eval={"every": eval_every, "generate": False},
        checkpoint={"best_metric": "eval.loss", "every": 1},
        output={"merge": True},
    )
    return recipe_from_dict(raw)


def test_a_failed_relaunch_keeps_the_results_and_a_lost_lock_stops_the_run_with_a_checkpoint(
    cache_dir, tmp_path
):
    # A folder lorakit did not make is refused before anything is written into it.
    project = tmp_path / "project"
    (project / "model").mkdir(parents=True)
    with pytest.raises(RunDirError, match=f"output.dir {project} is not empty and is not a lorakit run"):
        lorakit.train(_recipe(cache_dir, project))
    assert [p.name for p in project.iterdir()] == ["model"]

    run = tmp_path / "run"
    lorakit.train(_recipe(cache_dir, run))
    results = {name: _tree(run / name) for name in (rundir.ADAPTER, rundir.MERGED, rundir.BEST)}
    assert all(results.values()) and (run / rundir.MARKER).is_file()

    # Relaunch the finished run (resume: auto, from its last checkpoint) with an evaluation setting changed
    # (the same recipe again would be told the run is complete); it fails once the model is loaded.
    undo = inject("tracker start")
    try:
        with pytest.raises(RuntimeError, match="injected in tracker start"):
            lorakit.train(_recipe(cache_dir, run, eval_every=1))
    finally:
        undo()
    assert {name: _tree(run / name) for name in results} == results
    assert not [p.name for p in run.iterdir() if ".tmp-" in p.name or ".old-" in p.name]
    assert [c.step for c in complete_checkpoints(run)] == [1, 2]

    # Start over (resume: never) and lose the lock at step 1: another holder's token appears in run.lock.
    def take_over() -> None:
        holder = json.loads((run / LOCK).read_text())
        (run / LOCK).write_text(json.dumps({**holder, "token": "usurper", "host": "elsewhere", "pid": 1}))
        # The watch reads run.lock at most once a second (LockWatch.every): wait that out, so the next step
        # boundary sees the new holder however fast the tiny steps run.
        time.sleep(1.1)

    undo = inject("step", nth=1, action=take_over)
    try:
        with pytest.raises(Preempted, match="the run lock .* was taken over by pid 1 on host elsewhere") as e:
            # No evaluation before the epoch's end (8 steps), so nothing of the earlier run is replaced.
            lorakit.train(_recipe(cache_dir, run, eval_every=1000, max_steps=10_000, resume="never"))
    finally:
        undo()
    assert e.value.exit_code == 75
    # A periodic checkpoint (checkpoint.every 1) may come before the stop's own.
    *_, stopped = complete_checkpoints(run)
    assert stopped.state["reason"] == "preempted" and stopped.step < 8
    # The earlier checkpoints were moved aside (recorded), not deleted; the finished run's results are whole.
    [record] = branches.moved_aside(run)
    assert record["moved"] == ["checkpoints/step-00000001", "checkpoints/step-00000002"]
    assert {name: _tree(run / name) for name in results} == results
    assert json.loads((run / LOCK).read_text())["token"] == "usurper"  # the new holder's lock is left alone
