"""The same command on a finished run: it says the run is complete, in one line, and exits 0 at once (no
resume at step N of N, no evaluation, nothing written); anything else about the run directory (a changed
recipe, train.resume: never, a failed or newer launch) goes on as before."""

from __future__ import annotations

import importlib
import os
import time

import yaml

from lorakit import rundir
from tests.conftest import tiny_recipe_dict

run_main = importlib.import_module("lorakit.run").main


def _recipe_file(cache_dir, tmp_path):
    raw = tiny_recipe_dict(cache_dir, tmp_path / "run", train={"max_steps": 2}, eval={"enabled": False})
    path = tmp_path / "recipe.yaml"
    path.write_text(yaml.safe_dump(raw))
    return path


def _state(run_dir):
    return {p.relative_to(run_dir): p.stat().st_mtime_ns for p in run_dir.rglob("*")}


def test_a_finished_run_relaunched_says_it_is_complete_and_exits_at_once(cache_dir, tmp_path, capsys):
    path = _recipe_file(cache_dir, tmp_path)
    assert run_main([str(path)]) == 0
    capsys.readouterr()
    run_dir = tmp_path / "run"
    before = _state(run_dir)
    start = time.monotonic()
    assert run_main([str(path)]) == 0
    took = time.monotonic() - start
    out = capsys.readouterr().out
    assert out.splitlines() == [
        f"run already complete: {run_dir} (2 steps, loss {rundir.read_summary(run_dir)['loss']['last']:.4f}); "
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
