"""ORPO and KTO end to end: 2 processes on ZeRO-3 with a tiny Llama and LoRA, packed rows with the prompt
once. ORPO reaches held-out preference accuracy above 80% on the builtin preference pairs; KTO's reward
margin between desirable and undesirable held-out rows (builtin kto_rows) is positive and grows. Each run
is then resumed from its middle checkpoint and repeats the uninterrupted run: the same step records and the
same adapter."""

from __future__ import annotations

import shutil

import pytest
import torch

import lorakit
from lorakit import rundir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.recipe.alignment_section import KTO_STEP_METRICS, ORPO_METRICS
from tests.conftest import tiny_recipe

DATA = {
    "orpo": {"source": "builtin:preference_pairs", "input_column": "question"},
    "kto": {"source": "builtin:kto_rows", "input_column": "prompt"},
}
# Steps, evaluated and checkpointed halfway and at the end.
STEPS = {"orpo": 6, "kto": 8}
STEP_KEYS = {"orpo": (*ORPO_METRICS, "nll", "log_odds_ratio"), "kto": KTO_STEP_METRICS}


def _adapter(run_dir) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(run_dir / "adapter" / "adapter_model.safetensors"))


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["orpo", "kto"])
def test_zero3_two_processes_learn_and_resume_identically(cache_dir, tmp_path, objective):
    steps = STEPS[objective]
    recipe = tiny_recipe(
        cache_dir,
        tmp_path / "run",
        model={"name_or_path": "tiny:llama", "gradient_checkpointing": True},
        method={"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        data={
            **DATA[objective],
            "prompt_template": "{input}\n",
            "max_samples": 160,
            "max_eval_samples": 32,
            "packing": True,
        },
        train={"objective": objective, "max_steps": steps, "lr": 5e-3, "micro_batch_size": 8},
        eval={"generate": False, "every": steps // 2},
        checkpoint={"every": steps // 2, "keep": 3},
        distributed={"num_processes": 2, "zero_stage": 3},
    )
    whole = lorakit.train(recipe)
    records = rundir.read_metrics(whole.run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    # Halfway, the end, and (KTO's 160 rows) an epoch's end between.
    assert evals[0]["step"] == steps // 2 and evals[-1]["step"] == steps
    assert all(set(STEP_KEYS[objective]) <= set(r) for r in train), train[0]
    if objective == "orpo":
        assert evals[-1]["accuracy"] > 80, evals
        assert train[-1]["nll"] < train[0]["nll"] and train[-1]["log_odds_ratio"] > train[0]["log_odds_ratio"]
    else:
        # No dropout: before the first update the policy is its reference (rewards 0, loss 1/2 a row).
        assert train[0]["loss"] == pytest.approx(0.5, abs=1e-5) and train[0]["kl"] == 0.0
        assert 0 < evals[0]["margin"] < evals[-1]["margin"], evals
        assert 0.2 < evals[-1]["desirable_share"] < 0.8 and evals[-1]["rewards/undesirable"] < 0
    assert f"{objective} " in " ".join(whole.summary["method_options"])  # `orpo lambda=0.1`, `kto beta=0.1`
    adapter = _adapter(whole.run_dir)

    # As if the run had stopped after its middle checkpoint.
    found = complete_checkpoints(whole.run_dir)
    assert found[0].step == steps // 2 and found[-1].step == steps  # (KTO: and its epoch's end, step 6)
    for later in found[1:]:
        shutil.rmtree(later.path)
    resumed = lorakit.train(recipe)
    assert resumed.summary["resumed_from"]["step"] == steps // 2
    again = [r for r in rundir.read_metrics(resumed.run_dir) if r["kind"] == "train"]
    keys = ("step", "loss", "grad_norm", *STEP_KEYS[objective])
    assert [r[k] for r in again for k in keys] == pytest.approx([r[k] for r in train for k in keys], abs=1e-6)
    again_adapter = _adapter(resumed.run_dir)
    assert again_adapter.keys() == adapter.keys()
    assert all(torch.equal(again_adapter[k], adapter[k]) for k in adapter)
