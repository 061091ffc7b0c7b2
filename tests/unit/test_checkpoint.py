"""Checkpoint bookkeeping: what counts as the same run, which checkpoints are complete, skipping trained
batches, RNG round trips, and metrics.jsonl on resume."""

from __future__ import annotations

import json
import random

import numpy as np
import pytest
import torch

from lorakit import rundir
from lorakit.data.sampler import LengthGroupedBatchSampler, ResumableBatchSampler
from lorakit.engine import branches, compatibility, rng
from lorakit.engine import checkpoint as ck
from lorakit.errors import RecipeError
from lorakit.observe import JsonlSink
from tests.conftest import tiny_recipe


def _recipe(tmp_path, **sections):
    return tiny_recipe(tmp_path / "cache", tmp_path / "run", **sections)


def _fake_checkpoint(run_dir, step, recipe, world=1, complete=True):
    d = run_dir / "checkpoints" / (f"step-{step:08d}" if complete else f".tmp-step-{step:08d}")
    (d / ck.ENGINE).mkdir(parents=True)
    state = {
        "format": compatibility.FORMAT_VERSION,
        "reason": "every",
        "world_size": world,
        "fingerprint": compatibility.recipe_fingerprint(recipe),
        "recipe": recipe.model_dump(mode="json"),
        "loop": {"step": step},
    }
    (d / ck.STATE).write_text(json.dumps(state))
    return d


def test_fingerprint_covers_the_trajectory_and_ignores_the_rest(tmp_path):
    base = compatibility.recipe_fingerprint(_recipe(tmp_path))
    assert compatibility.recipe_fingerprint(_recipe(tmp_path, train={"lr": 1e-4})) != base
    assert compatibility.recipe_fingerprint(_recipe(tmp_path, data={"max_samples": 16})) != base
    assert compatibility.recipe_fingerprint(_recipe(tmp_path, train={"epochs": 2})) != base
    # Evaluation, logging, checkpoint policy and where outputs go do not change what is trained.
    for same in (
        _recipe(tmp_path, eval={"enabled": False}),
        _recipe(tmp_path, train={"log_every": 5, "resume": "never"}),
        _recipe(tmp_path, checkpoint={"every": 3, "keep": 5}),
        _recipe(tmp_path, output={"dir": str(tmp_path / "elsewhere"), "merge": True}),
    ):
        assert compatibility.recipe_fingerprint(same) == base


def test_a_checkpoint_of_another_recipe_or_world_size_is_refused_naming_why(tmp_path):
    old = _recipe(tmp_path)
    d = _fake_checkpoint(tmp_path / "run", 4, old, world=2)
    ckpt = ck.read_checkpoint(d)
    with pytest.raises(RecipeError, match="written by 2 processes and this run has 1"):
        compatibility.check_compatible(ckpt, old, world=1)
    with pytest.raises(RecipeError, match=r"train\.lr: 0\.003 then, 0\.0001 now"):
        compatibility.check_compatible(ckpt, _recipe(tmp_path, train={"lr": 1e-4}), world=2)
    compatibility.check_compatible(ckpt, _recipe(tmp_path, eval={"enabled": False}), world=2)


def test_only_published_checkpoints_count_and_prune_keeps_the_newest(tmp_path):
    recipe = _recipe(tmp_path)
    run = tmp_path / "run"
    for step in (2, 4, 6):
        _fake_checkpoint(run, step, recipe)
    _fake_checkpoint(run, 8, recipe, complete=False)  # a save that crashed before its rename
    (run / "checkpoints" / "step-00000010").mkdir()  # no state.json: not complete
    assert [c.step for c in ck.complete_checkpoints(run)] == [2, 4, 6]
    ck.prune(run, keep=2)
    assert [c.step for c in ck.complete_checkpoints(run)] == [4, 6]
    assert not (run / "checkpoints" / ".tmp-step-00000008").exists()


def test_resume_never_sets_old_checkpoints_aside_and_a_bad_path_is_a_clear_error(tmp_path):
    recipe = _recipe(tmp_path, train={"resume": "never"})
    _fake_checkpoint(tmp_path / "run", 2, recipe)
    assert ck.find_resume(recipe, tmp_path / "run") is None
    # Not deleted: moved aside (recorded), where neither auto nor pruning sees them.
    assert ck.complete_checkpoints(tmp_path / "run") == []
    [record] = branches.moved_aside(tmp_path / "run")
    assert record["why"] == "train.resume: never" and record["moved"] == ["checkpoints/step-00000002"]
    missing = _recipe(tmp_path, train={"resume": str(tmp_path / "nope")})
    with pytest.raises(RecipeError, match="is not a complete lorakit checkpoint"):
        ck.find_resume(missing, tmp_path / "run")


def test_resume_auto_picks_the_newest_complete_checkpoint(tmp_path):
    recipe = _recipe(tmp_path)
    for step in (2, 4):
        _fake_checkpoint(tmp_path / "run", step, recipe)
    _fake_checkpoint(tmp_path / "run", 6, recipe, complete=False)
    assert ck.find_resume(recipe, tmp_path / "run").step == 4
    assert ck.find_resume(recipe, tmp_path / "fresh") is None


def test_resumable_sampler_skips_exactly_the_trained_batches_once():
    inner = LengthGroupedBatchSampler(list(range(1, 41)), 4, seed=3)
    sampler = ResumableBatchSampler(inner)
    sampler.set_epoch(2)
    full = list(inner)
    sampler.skip_next(3)
    assert list(sampler) == full[3:]
    assert list(sampler) == full  # the skip applies to one pass only
    assert len(sampler) == len(inner)
    with pytest.raises(ValueError, match="cannot skip"):
        sampler.skip_next(len(inner) + 1)


def test_rng_states_round_trip():
    meta, tensors = rng.rng_state()
    draws = (random.random(), np.random.rand(), torch.rand(3))
    rng.set_rng_state(json.loads(json.dumps(meta)), tensors)
    again = (random.random(), np.random.rand(), torch.rand(3))
    assert draws[0] == again[0] and draws[1] == again[1] and torch.equal(draws[2], again[2])


def test_metrics_log_keeps_the_lines_up_to_the_checkpoint(tmp_path):
    path = tmp_path / "metrics.jsonl"
    log = JsonlSink(path)
    for step in range(1, 6):
        log.write({"step": step})
    log.close()
    resumed = JsonlSink(path, keep=3)
    assert resumed.count == 3
    resumed.write({"step": 4})
    resumed.close()
    assert [r["step"] for r in rundir.read_metrics(tmp_path)] == [1, 2, 3, 4]


def test_skipping_nonfinite_steps_needs_a_zero_stage_or_bf16(tmp_path):
    for dtype in ("float32", "float16"):
        with pytest.raises(Exception, match="on_nonfinite: skip needs distributed.zero_stage 1, 2 or 3"):
            _recipe(
                tmp_path,
                train={"on_nonfinite": "skip"},
                distributed={"zero_stage": 0},
                model={"dtype": dtype},
            )
    _recipe(tmp_path, train={"on_nonfinite": "skip"}, distributed={"zero_stage": 2})
    # Stage 0 in bf16: lorakit's own optimizer leaves the update out (backends/deepspeed_bf16.py).
    _recipe(
        tmp_path, train={"on_nonfinite": "skip"}, distributed={"zero_stage": 0}, model={"dtype": "bfloat16"}
    )


def test_the_launcher_removes_a_failed_saves_leftovers_once_every_worker_is_gone(tmp_path):
    # Rank 0 ran out of space and removed the partial checkpoint, but rank 1 was still writing its shard
    # into it: when torchrun returns, the launcher (the only writer left) removes what remains.
    from lorakit import api
    from lorakit.engine.job import EXIT
    from lorakit.errors import DiskFullError

    recipe = _recipe(tmp_path)
    run = tmp_path / "run"
    _fake_checkpoint(run, 2, recipe)
    leftover = run / "checkpoints" / ".tmp-step-00000004"
    (leftover / "engine").mkdir(parents=True)
    (leftover / "engine" / "zero_pp_rank_1_mp_rank_00_optim_states.pt").write_bytes(b"partial")
    rundir.write_json(run / EXIT, {"code": 74, "error": "DiskFullError", "message": "no space left"})
    with pytest.raises(DiskFullError, match="no space left"):
        api._after_workers(run, returncode=1)
    assert not leftover.exists()
    assert [c.step for c in ck.complete_checkpoints(run)] == [2]
