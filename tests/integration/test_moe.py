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


@pytest.mark.parametrize("kind", ("mixtral", "qwen3_moe", "olmoe"))
@pytest.mark.slow
def test_the_causal_quickstart_with_each_moe_model_trains_on_two_zero3_processes_and_merges_verified(
    kind, cache_dir, tmp_path, monkeypatch
):
    """recipes/quickstart_causal.yaml with only the model changed (bf16, LoRA with dropout 0.05, 2 processes,
    ZeRO-3; fewer examples, one epoch (2 steps), a short evaluation and no generation to keep it short: no
    check reads the loss or the evaluation): it trains, says where dropout applies, which
    experts path it took and that the experts received gradients; its adapter merges verified in bf16 (the
    routing fixed), and a wrong merge (the delta twice) is refused. (The quick doctor in bf16 passes for each
    family in test_doctor.py, and fails a wrong merge in tests/unit/test_moe_contracts.py.)"""
    import lorakit
    import lorakit.export.job as job
    from lorakit.errors import VerificationError
    from tests.conftest import RECIPES, run_cli
    from tests.unit.test_moe_contracts import _scaled_merge

    run_dir = tmp_path / "run"
    proc = run_cli(
        "lorakit.run",
        RECIPES / "quickstart_causal.yaml",
        f"model.name_or_path=tiny:{kind}",
        "data.max_samples=48",
        "data.max_eval_samples=8",
        "train.epochs=1",
        "eval.generate=false",
        f"data.cache_dir={cache_dir}",
        f"output.dir={run_dir}",
    )
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    assert out.count("LoRA dropout 0.05 on the linear layers' adapters, none on the fused experts") == 1
    assert out.count("experts: transformers' 'grouped_mm' path") == 1  # CPU: transformers' own experts path
    assert out.count("received gradients in the first step") == 1
    result = lorakit.merge(run_dir, tmp_path / "merged")
    assert result.strategy == "memory" and all(c.passed for c in result.checks), result.checks
    assert result.checks[0].effect_visible
    monkeypatch.setattr(job, "_merge_weights", _scaled_merge)
    with pytest.raises(VerificationError):
        lorakit.merge(run_dir, tmp_path / "scaled")
    assert not (tmp_path / "scaled").exists()
