"""Mixture of experts end to end: a tiny Mixtral run merges, verified; the doctor's contracts pass for it. (The
2-process ZeRO-3 step with skewed routing of each MoE family is in test_token_weighting.py, whose one launch
takes every two-rank step.)"""

import json

import pytest


@pytest.mark.slow
def test_a_tiny_mixtral_run_logs_its_aux_loss_merges_verified_and_passes_the_doctor(
    cache_dir, tmp_path, capfd
):
    """Packed SFT with LoRA on the experts and the shipped recipes' dropout (0.05: on the linear layers'
    adapters, none on the experts), a few steps on one process: it says so once, and how many expert adapters
    the first step reached; the aux loss is in metrics.jsonl;
    the merge falls back to peft's in-memory merge (fused expert parameters are no per-tensor W + B A) and
    verifies against the adapter; the doctor's contracts pass on the recipe."""
    import lorakit
    from lorakit.doctor import run_doctor
    from tests.conftest import tiny_recipe

    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:mixtral"},
        data={"format": "instruction", "max_length": "auto"},
        method={"dropout": 0.05},
        train={"max_steps": 3, "lr": 1e-2},
        eval={"generate": False},
    )
    run_dir = lorakit.train(recipe).run_dir
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    aux = [s["aux_loss"] for s in steps if "aux_loss" in s]
    assert len(aux) == 3 and all(a > 0 for a in aux)
    out = capfd.readouterr().out
    assert out.count("none on the fused experts") == 1
    assert out.count("expert adapters (4 fused stacks) received gradients in the first step") == 1
    result = lorakit.merge(run_dir, tmp_path / "merged")
    assert result.strategy == "memory" and all(c.passed for c in result.checks)
    assert result.checks[0].effect_visible
    report = run_doctor(recipe, quick=True, sections=("contracts",))
    assert report.ok, report.table()
