"""ORPO and KTO end to end: 2 processes on ZeRO-3 with a tiny Llama and LoRA, packed rows with the prompt
once. ORPO reaches held-out preference accuracy above 80% on the builtin preference pairs; KTO's reward
margin between desirable and undesirable held-out rows (builtin kto_rows) is positive and grows. Each run
is then resumed from its middle checkpoint and repeats the uninterrupted run: the same step records and the
same adapter. The two whole runs and then the two resumed runs share one 2-process launch (qlora_worker.py
trains recipes in order)."""

from __future__ import annotations

import pytest
import torch

from lorakit import rundir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.recipe.alignment_section import KTO_STEP_METRICS, ORPO_METRICS
from tests.conftest import ROOT, tiny_recipe_dict
from tests.integration.qlora_worker import train_in_one_launch

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


def _recipe(cache_dir, out, objective: str) -> dict:
    steps = STEPS[objective]
    return tiny_recipe_dict(
        cache_dir,
        out,
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


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory) -> dict[str, dict]:
    """Per objective: the whole run's records, summary, adapter and checkpoint steps, and the run resumed
    from its middle checkpoint into a directory of its own (as if it had stopped there): `resumed` is its
    summary, `again` its records (the steps after the checkpoint) and `again_adapter` its adapter. All four
    runs in one launch, the resumed ones after the whole ones."""
    base = tmp_path_factory.mktemp("alignment")
    recipes = {base / f"{o}.yaml": _recipe(cache_dir, base / o, o) for o in STEPS}
    for o, steps in STEPS.items():
        middle = base / o / "checkpoints" / f"step-{steps // 2:08d}"
        resumed = _recipe(cache_dir, base / f"{o}-resumed", o)
        resumed["train"]["resume"] = str(middle)
        recipes[base / f"{o}-resumed.yaml"] = resumed
    train_in_one_launch(recipes, {"PYTHONPATH": str(ROOT)})
    out = {}
    for objective in STEPS:
        run_dir, again = base / objective, base / f"{objective}-resumed"
        out[objective] = {
            "records": rundir.read_metrics(run_dir),
            "summary": rundir.read_summary(run_dir),
            "adapter": _adapter(run_dir),
            "checkpoints": [c.step for c in complete_checkpoints(run_dir)],
            "resumed": rundir.read_summary(again),
            "again": rundir.read_metrics(again),
            "again_adapter": _adapter(again),
        }
    return out


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["orpo", "kto"])
def test_zero3_two_processes_learn_and_resume_identically(runs, objective):
    steps = STEPS[objective]
    whole = runs[objective]
    records = whole["records"]
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
    assert f"{objective} " in " ".join(
        whole["summary"]["method_options"]
    )  # `orpo lambda=0.1`, `kto beta=0.1`
    adapter = whole["adapter"]

    # As if the run had stopped after its middle checkpoint: the run resumed from it repeats every later step.
    found = whole["checkpoints"]
    assert found[0] == steps // 2 and found[-1] == steps  # (KTO: and its epoch's end, step 6)
    assert whole["resumed"]["resumed_from"]["step"] == steps // 2
    again = [r for r in whole["again"] if r["kind"] == "train"]
    later = [r for r in train if r["step"] > steps // 2]
    assert [r["step"] for r in again] == list(range(steps // 2 + 1, steps + 1))
    keys = ("step", "loss", "grad_norm", *STEP_KEYS[objective])
    assert [r[k] for r in again for k in keys] == pytest.approx([r[k] for r in later for k in keys], abs=1e-6)
    again_adapter = whole["again_adapter"]
    assert again_adapter.keys() == adapter.keys()
    assert all(torch.equal(again_adapter[k], adapter[k]) for k in adapter)
