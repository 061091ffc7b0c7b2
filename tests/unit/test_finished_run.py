"""The same command on a finished run: it says the run is complete, in one line, and exits 0 at once (no
resume at step N of N, no evaluation, nothing written); anything else about the run directory (a changed
recipe, train.resume: never, a failed or newer launch) goes on as before."""

from __future__ import annotations

import contextlib
import importlib
import io
import os
import shutil
import time

import pytest
import yaml

from lorakit import rundir
from tests.conftest import tiny_recipe_dict

run_main = importlib.import_module("lorakit.run").main


@pytest.fixture(scope="module")
def finished(cache_dir, tmp_path_factory):
    """A tiny run trained to the end by `python -m lorakit.run`'s main: (recipe path, run dir, console)."""
    tmp_path = tmp_path_factory.mktemp("finished")
    raw = tiny_recipe_dict(
        cache_dir,
        tmp_path / "run",
        train={"max_steps": 3},
        eval={"every": 2, "generate": False},
        checkpoint={"every": 1, "keep": 1},
    )
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        assert run_main([str(path)]) == 0
    return path, tmp_path / "run", out.getvalue() + err.getvalue()


def test_the_console_says_when_it_evaluates_lists_the_plot_and_keeps_checkpoint_pruning_quiet(finished):
    path, run_dir, console = finished
    lines = console.splitlines()
    # The bar stands still while the model evaluates: a line says so (step 2, and the end's at step 3).
    assert [line for line in lines if line.startswith("evaluating at step")] == [
        "evaluating at step 2: 8 rows",
        "evaluating at step 3: 8 rows",
    ], console
    assert f"plot:     {run_dir / 'loss.png'}" in lines and (run_dir / "loss.png").is_file()
    assert not [line for line in lines if "removed checkpoint" in line], console


def _state(run_dir):
    return {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


def test_a_finished_run_relaunched_says_it_is_complete_and_exits_at_once(finished, capsys):
    path, run_dir, _ = finished
    before = _state(run_dir)
    start = time.monotonic()
    assert run_main([str(path)]) == 0
    took = time.monotonic() - start
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"run already complete: {run_dir} (3 steps, loss {rundir.read_summary(run_dir)['loss']['last']:.4f}); "
        "nothing to do (train.resume=never trains it again)"
    ], out
    assert _state(run_dir) == before  # nothing written, nothing evaluated again
    assert took < 15, took  # checks and one file compare: no data preparation, no model


def test_only_a_run_finished_with_this_recipe_is_complete(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    resolved = "train:\n  epochs: 2\n"
    (run_dir / rundir.RECIPE).write_text(resolved)
    assert not rundir.completed_with(run_dir, resolved)  # no summary: never finished
    rundir.write_json(run_dir / rundir.SUMMARY, {"stop_reason": "epochs", "steps": 4})
    assert rundir.completed_with(run_dir, resolved)
    assert not rundir.completed_with(run_dir, "train:\n  epochs: 3\n")  # another recipe: it decides
    (run_dir / rundir.EXIT).write_text('{"code": 75}')
    assert not rundir.completed_with(run_dir, resolved)  # preempted (or failed) after its summary
    (run_dir / rundir.EXIT).unlink()
    # A later launch rewrote the recipe and stopped before a summary of its own (killed: no exit.json).
    later = time.time_ns() + 10**9
    os.utime(run_dir / rundir.RECIPE, ns=(later, later))
    assert not rundir.completed_with(run_dir, resolved)


def test_a_run_whose_final_checkpoint_is_gone_is_not_complete(tmp_path):
    """A finished run whose last checkpoint (summary.json's last_checkpoint) was removed, as test_dpo's full
    fine-tuning resume check does to stop the run "after step 2", resumes from what is left: the relaunch
    trains the missing steps again instead of calling the run complete."""
    run_dir = tmp_path / "run"
    resolved = "train:\n  epochs: 2\n"
    for step in (2, 4):
        ckpt = run_dir / rundir.CHECKPOINTS / f"step-{step:08d}"
        ckpt.mkdir(parents=True)
        (ckpt / "state.json").write_text("{}")
    (run_dir / rundir.RECIPE).write_text(resolved)
    last = str(run_dir / rundir.CHECKPOINTS / "step-00000004")
    rundir.write_json(
        run_dir / rundir.SUMMARY, {"stop_reason": "epochs", "steps": 4, "last_checkpoint": last}
    )
    assert rundir.completed_with(run_dir, resolved)
    shutil.rmtree(last)
    assert not rundir.completed_with(run_dir, resolved)
    # A run that saved no checkpoint: its summary decides.
    rundir.write_json(
        run_dir / rundir.SUMMARY, {"stop_reason": "epochs", "steps": 4, "last_checkpoint": None}
    )
    assert rundir.completed_with(run_dir, resolved)
