"""A NaN loss stops the run naming the step (exit code 4, last checkpoint kept), or is skipped and
counted when the recipe says so."""

from __future__ import annotations

import math

import pytest
import torch
import yaml
from safetensors.torch import load_file

import lorakit
import lorakit.engine.loop as loop
import lorakit.objectives.sft as objective
from lorakit import rundir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict
from tests.integration.test_resume import launch


def _raw(cache_dir, out, zero_stage=2, dtype="float32", **train):
    return tiny_recipe_dict(
        cache_dir,
        out,
        model={"dtype": dtype},
        train={"max_steps": 5, "micro_batch_size": 4, **train},
        distributed={"zero_stage": zero_stage},
        eval={"enabled": False},
        checkpoint={"every": 2},
    )


@pytest.mark.slow
def test_nan_loss_stops_with_exit_4_naming_the_step_and_keeps_the_checkpoint(cache_dir, tmp_path):
    recipe = tmp_path / "recipe.yaml"
    recipe.write_text(yaml.safe_dump(_raw(cache_dir, tmp_path / "run")))
    proc = launch(recipe, fault="nan:3")
    assert proc.returncode == 4, proc.stderr[-5000:]
    assert "error: step 3: loss nan" in proc.stderr and "Traceback" not in proc.stderr
    assert "on_nonfinite: skip" in proc.stderr
    run = tmp_path / "run"
    assert [c.step for c in complete_checkpoints(run)] == [2]
    assert not (run / "summary.json").exists()
    assert rundir.read_metrics(run)[-1]["step"] == 3


@pytest.mark.slow
@pytest.mark.parametrize(
    "zero_stage,dtype",
    # ZeRO's optimizer leaves the update out at stage 2; lorakit's own at stage 0 in bf16 (deepspeed_bf16.py).
    [(2, "float32"), (0, "bfloat16")],
    ids=["zero2-fp32", "zero0-bf16"],
)
def test_nan_loss_skipped_leaves_weights_finite_and_is_counted(
    cache_dir, tmp_path, monkeypatch, zero_stage, dtype
):
    real = objective.token_loss_sum
    calls = {"n": 0}

    def nan_on_third(*args, **kwargs):
        calls["n"] += 1
        out = real(*args, **kwargs)
        return out * float("nan") if calls["n"] == 3 else out

    monkeypatch.setattr(objective, "token_loss_sum", nan_on_third)
    recipe = recipe_from_dict(
        _raw(cache_dir, tmp_path / "run", zero_stage=zero_stage, dtype=dtype, on_nonfinite="skip")
    )
    s = lorakit.train(recipe).summary
    assert s["skipped_steps"] == [3] and s["steps"] == 5
    assert all(math.isfinite(x) for x in (s["loss"]["first"], s["loss"]["last"]))
    skipped = [r for r in rundir.read_metrics(tmp_path / "run") if r.get("skipped")]
    assert [r["step"] for r in skipped] == [3]
    adapter = load_file(str(tmp_path / "run" / "adapter" / "adapter_model.safetensors"))
    assert all(torch.isfinite(t).all() for t in adapter.values())


@pytest.mark.slow
def test_too_many_skipped_steps_stop_the_run(cache_dir, tmp_path, monkeypatch):
    real = objective.token_loss_sum
    monkeypatch.setattr(objective, "token_loss_sum", lambda *a, **k: real(*a, **k) * float("nan"))
    recipe = recipe_from_dict(_raw(cache_dir, tmp_path / "run", on_nonfinite="skip", max_skipped_steps=1))
    with pytest.raises(loop.TrainingDiverged, match=r"more than train.max_skipped_steps=1 .*steps \[1, 2\]"):
        lorakit.train(recipe)
