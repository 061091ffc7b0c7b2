"""distributed.strategy fsdp end to end: real launches of `python -m lorakit.run` on 2 processes (FSDP2 full
sharding, gloo), preempted by SIGTERM and resumed, the adapter saved whole and merged. The step-level
equivalence with DeepSpeed and one process is in test_token_weighting.py."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from safetensors.torch import load_file

from lorakit import rundir
from tests.conftest import tiny_recipe_dict
from tests.integration.test_resume import assert_same_run, launch, preempt

STEPS = 4


def _recipe(cache_dir: Path, out: Path, path: Path, **output) -> Path:
    raw = tiny_recipe_dict(
        cache_dir,
        out,
        # Dropout on: a resume must restore the RNG streams, not only the weights.
        method={"dropout": 0.1},
        train={"max_steps": STEPS, "micro_batch_size": 2, "gradient_accumulation_steps": 2},
        distributed={"num_processes": 2, "zero_stage": 3, "strategy": "fsdp"},
        eval={"enabled": False},
        checkpoint={"every": 2, "keep": 2},
        output=output,
    )
    path.write_text(yaml.safe_dump(raw))
    return path


@pytest.mark.slow
def test_fsdp_run_saves_whole_adapter_merges_and_resumes_after_sigterm_as_uninterrupted(cache_dir, tmp_path):
    ref = tmp_path / "ref"
    done = launch(_recipe(cache_dir, ref / "run", tmp_path / "ref.yaml", merge=True))
    assert done.returncode == 0, done.stderr[-5000:]
    run = ref / "run"
    # The backend's record instead of a DeepSpeed config; the adapter whole (the LoRA B rows of both
    # ranks' shards: lora_B of a 64-wide projection with r 4 is 64 x 4); merged and verified after training.
    assert json.loads((run / "fsdp_config.json").read_text())["mesh"] == {"shard": 2}
    assert not (run / rundir.DS_CONFIG).exists()
    adapter = load_file(str(run / "adapter" / "adapter_model.safetensors"))
    config = json.loads((run / "adapter" / "adapter_config.json").read_text())
    b = [t for k, t in adapter.items() if "lora_B" in k]
    assert b and all(t.shape[1] == config["r"] and t.shape[0] > config["r"] for t in b)
    assert all(t.abs().sum() > 0 for t in b)
    summary = rundir.read_summary(run)
    assert summary["steps"] == STEPS and Path(summary["merged_dir"]).is_dir()
    assert summary["strategy"] == "fsdp"

    recipe = _recipe(cache_dir, tmp_path / "run", tmp_path / "recipe.yaml")
    # Step 2, not 1: a SIGTERM before the other rank has entered the loop (and installed its handler)
    # would end that rank as the default handler does.
    _, stopped_at = preempt(recipe, tmp_path / "run", at=2, steps=STEPS)
    resumed = launch(recipe)
    assert resumed.returncode == 0, resumed.stderr[-5000:]
    assert rundir.read_summary(tmp_path / "run")["resumed_from"]["step"] == stopped_at
    assert_same_run(tmp_path / "run", run, steps=STEPS)
