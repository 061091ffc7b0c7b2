"""Mixture of experts on 2 CPU processes: for each MoE family (Mixtral, Qwen3-MoE, OLMoE), a ZeRO-3 step with
deliberately skewed routing completes (the MoE block is a ZeRO-3 leaf) and equals the same window accumulated
on one process, the load-balancing loss included; a tiny Mixtral run merges, verified; the doctor's
contracts pass for it."""

import json
import subprocess
from pathlib import Path

import pytest
import torch

from lorakit.engine.launch import torchrun_command
from tests.integration import moe_worker

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_a_zero3_step_with_skewed_routing_completes_and_equals_one_process(cache_dir, tmp_path):
    moe_worker.main(str(cache_dir), str(tmp_path), "accumulate")
    cmd = torchrun_command(2, "tests.integration.moe_worker", [str(cache_dir), str(tmp_path), "two_ranks"])
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-5000:]
    for kind in moe_worker.KINDS:
        one, two = (
            json.loads((tmp_path / f"{kind}-{m}.json").read_text()) for m in ("accumulate", "two_ranks")
        )
        assert one["metrics"]["aux_loss"] > 0, kind
        for key in ("loss", "grad_norm"):
            assert two[key] == pytest.approx(one[key], rel=1e-4), f"{kind}: {key}"
        assert two["metrics"]["aux_loss"] == pytest.approx(one["metrics"]["aux_loss"], rel=1e-4), kind
        weights = {m: torch.load(tmp_path / f"{kind}-{m}.pt") for m in ("accumulate", "two_ranks")}
        assert any(".mlp.gate." in k for k in weights["accumulate"]) and any(
            ".experts." in k for k in weights["accumulate"]
        ), kind
        for key, w in weights["accumulate"].items():
            torch.testing.assert_close(
                weights["two_ranks"][key], w, rtol=1e-4, atol=1e-6, msg=f"{kind}: {key}"
            )


@pytest.mark.slow
def test_a_tiny_mixtral_run_logs_its_aux_loss_merges_verified_and_passes_the_doctor(cache_dir, tmp_path):
    """Packed SFT with LoRA on the experts, a few steps on one process: the aux loss is in metrics.jsonl;
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
        method={"dropout": 0.0},
        train={"max_steps": 3, "lr": 1e-2},
        eval={"generate": False},
    )
    run_dir = lorakit.train(recipe).run_dir
    steps = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    aux = [s["aux_loss"] for s in steps if "aux_loss" in s]
    assert len(aux) == 3 and all(a > 0 for a in aux)
    result = lorakit.merge(run_dir, tmp_path / "merged")
    assert result.strategy == "memory" and all(c.passed for c in result.checks)
    assert result.checks[0].effect_visible
    report = run_doctor(recipe, quick=True, sections=("contracts",))
    assert report.ok, report.table()
