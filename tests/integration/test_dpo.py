"""DPO end to end on the builtin preference pairs: 2 processes on ZeRO-3 for a tiny Llama and a tiny T5
(held-out preference accuracy from 50% to above 90%, the adapter merged and verified, generate and compare
on the run); full fine-tuning DPO on its cached reference, which learns, and QLoRA DPO on ZeRO-2 (dropout
on), each resumed identically in a fresh process (1 process).

ORPO and KTO end to end: 2 processes on ZeRO-3 with a tiny Llama and LoRA, packed rows with the prompt
once. ORPO reaches held-out preference accuracy above 80% on the builtin preference pairs; KTO's reward
margin between desirable and undesirable held-out rows (builtin kto_rows) is positive and grows.

The Llama DPO run and the ORPO and KTO runs train with LoRA dropout on; each is then resumed from its middle
checkpoint in a fresh launch (new processes: nothing but the checkpoint carries the RNG streams and the
optimizer state over) and must repeat the uninterrupted run: the same step records and the same adapter.

The whole runs share one 2-process launch, the resumed runs a second (qlora_worker.py trains recipes in
order; the second keeps going past a failed run, so one objective's failure hides no other's)."""

from __future__ import annotations

import math
import shutil
from pathlib import Path

import pytest
import torch
import yaml

import lorakit
from lorakit import rundir
from lorakit.engine.checkpoint import complete_checkpoints
from lorakit.objectives.alignment_settings import KTO_STEP_METRICS, ORPO_METRICS
from lorakit.objectives.dpo_settings import DPO_METRICS
from lorakit.recipe import recipe_from_dict
from tests.conftest import ROOT, run_cli, tiny_recipe_dict
from tests.integration.qlora_worker import finished, train_in_one_launch
from tests.integration.test_resume import _adapter

# Steps of the 2-process runs, evaluated halfway and at the end: the tiny Llama's shared-prompt rows hold
# 6 micro-batches of pairs an epoch, the tiny T5's padded ones 10; both are above 90% held-out accuracy at
# the halfway evaluation already (100% measured), so the end leaves a margin.
STEPS = {"llama": 6, "t5": 8}
ALIGNMENT_DATA = {
    "orpo": {"source": "builtin:preference_pairs", "input_column": "question"},
    "kto": {"source": "builtin:kto_rows", "input_column": "prompt"},
}
# Steps, evaluated and checkpointed halfway and at the end.
ALIGNMENT_STEPS = {"orpo": 6, "kto": 8}
ALIGNMENT_KEYS = {"orpo": (*ORPO_METRICS, "nll", "log_odds_ratio"), "kto": KTO_STEP_METRICS}
# Each objective's run resumed in a fresh launch (DPO's: the Llama run), its steps and its step metrics.
RESUMED = {"dpo": ("llama", STEPS["llama"]), "orpo": ("orpo", 6), "kto": ("kto", 8)}
RESUMED_KEYS = {"dpo": DPO_METRICS, **ALIGNMENT_KEYS}
# LoRA dropout on the resumed runs: a resume that lost the RNG streams draws other masks.
DROPOUT = 0.1


def _alignment_recipe(cache_dir, out, objective: str) -> dict:
    steps = ALIGNMENT_STEPS[objective]
    return tiny_recipe_dict(
        cache_dir,
        out,
        model={"name_or_path": "tiny:llama", "gradient_checkpointing": True},
        method={"r": 8, "alpha": 16, "dropout": DROPOUT, "target_modules": "all-linear"},
        data={
            **ALIGNMENT_DATA[objective],
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


def _recipe_dict(cache_dir, out, kind: str, **sections) -> dict:
    values = {
        "model": {"name_or_path": f"tiny:{kind}", "gradient_checkpointing": True},
        "method": {"r": 8, "alpha": 16, "dropout": 0.0, "target_modules": "all-linear"},
        "data": {
            "source": "builtin:preference_pairs",
            "input_column": "question",
            "prompt_template": "{input}\n",
            "max_samples": 160,
            "max_eval_samples": 32,
            "packing": True,
            "max_source_length": "auto",
            "max_target_length": "auto",
        },
        "train": {"objective": "dpo", "max_steps": 12, "lr": 5e-3, "micro_batch_size": 8},
        "dpo": {"beta": 0.1},
        "eval": {"generate": False, "every": 6},
    }
    for section, extra in sections.items():
        values[section] = {**values.get(section, {}), **extra}
    return tiny_recipe_dict(cache_dir, out, **values)


def _recipe(cache_dir, out, kind: str, **sections):
    return recipe_from_dict(_recipe_dict(cache_dir, out, kind, **sections))


def _zero3_dpo(cache_dir, out, kind: str) -> dict:
    """A kind's DPO run on 2 processes, merged at the end; the Llama's with dropout on and checkpointed
    halfway (it is DPO's resumed run)."""
    steps = STEPS[kind]
    llama = {"method": {"dropout": DROPOUT}, "checkpoint": {"every": steps // 2, "keep": 3}}
    return _recipe_dict(
        cache_dir,
        out,
        kind,
        distributed={"num_processes": 2, "zero_stage": 3},
        output={"merge": True},
        train={"max_steps": steps},
        eval={"every": steps // 2},
        **(llama if kind == "llama" else {}),
    )


@pytest.fixture(scope="module")
def two_process_runs(cache_dir, tmp_path_factory) -> tuple[Path, object]:
    """One launch (qlora_worker.py trains recipes in order): each kind's DPO run on ZeRO-3, merged at the
    end; the ORPO and KTO runs. Then a second launch resumes the Llama DPO, ORPO and KTO runs from their
    middle checkpoints, each into a directory of its own (as if it had stopped there). (The folder holding
    the run directories, the second launch's finished process.)"""
    base = tmp_path_factory.mktemp("preference-zero3")
    recipes = {base / f"{kind}.yaml": _zero3_dpo(cache_dir, base / kind, kind) for kind in STEPS}
    recipes |= {base / f"{o}.yaml": _alignment_recipe(cache_dir, base / o, o) for o in ALIGNMENT_STEPS}
    train_in_one_launch(recipes, {"PYTHONPATH": str(ROOT)})
    resumes = {}
    for objective, (name, steps) in RESUMED.items():
        resumed = yaml.safe_load((base / f"{name}.yaml").read_text())
        resumed["output"].update(dir=str(base / f"{objective}-resumed"), merge=False)
        # No check reads a resumed run's evaluations (the whole runs' are checked above): steps and adapter only.
        resumed["eval"] = {"enabled": False}
        resumed["train"]["resume"] = str(base / name / "checkpoints" / f"step-{steps // 2:08d}")
        resumes[base / f"{objective}-resumed.yaml"] = resumed
    return base, train_in_one_launch(resumes, {"PYTHONPATH": str(ROOT)}, keep_going=True)


@pytest.fixture(scope="module")
def zero3_runs(two_process_runs) -> dict[str, Path]:
    """The run directory of each kind's 2-process ZeRO-3 DPO run."""
    return {kind: two_process_runs[0] / kind for kind in STEPS}


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["llama", "t5"])
def test_dpo_zero3_two_processes_learns_the_preference_and_merges(zero3_runs, tmp_path, kind):
    run_dir = zero3_runs[kind]
    records = rundir.read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    # eval.every halfway, and the run's end.
    assert [e["step"] for e in evals] == [STEPS[kind] // 2, STEPS[kind]]
    for record in (*train, *evals):
        assert set(DPO_METRICS) <= set(record), record
    if kind == "llama":
        # No dropout in the tiny Llama, and LoRA's B starts at zero (whatever its dropout): before the first
        # update the policy is its reference exactly.
        assert train[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
        assert train[0]["accuracy"] == 50.0 and train[0]["margin"] == 0.0
    summary = rundir.read_summary(run_dir)
    assert summary["eval"]["accuracy"] > 90, evals
    assert summary["eval"]["margin"] > 0 and summary["eval"]["loss"] < math.log(2)
    assert summary["loss"]["last"] < summary["loss"]["first"]
    assert summary["merged_dir"] and (run_dir / "merged" / "config.json").is_file()

    # The run is an ordinary adapter run for generate and compare.
    # A text line is the value of the one column the prompt template reads (data.input_column).
    generated = lorakit.generate(
        run_dir, ["Describe the scene: a nurse reading a book at home."], max_new_tokens=4
    )
    assert len(generated.records) == 1 and "nurse" in generated.records[0]["prompt"]
    report = lorakit.compare([run_dir], output=tmp_path / "report")
    text = report.report.read_text()
    assert "eval accuracy" in text and "lora (dpo beta=0.1)" in text


def _relaunched(run_dir: Path) -> Path:
    """`python -m lorakit.run RUN/recipe.yaml` in a fresh process (forked from the session's warm interpreter:
    nothing of this process's training state), as after a preemption: it resumes from the newest checkpoint
    left (step 2) and finishes the run. Returns the run directory."""
    proc = run_cli("lorakit.run", run_dir / rundir.RECIPE)
    assert proc.returncode == 0, proc.stderr[-5000:]
    assert rundir.read_summary(run_dir)["resumed_from"]["step"] == 2
    return run_dir


@pytest.mark.slow
def test_full_fine_tuning_dpo_learns_and_resumes_in_a_fresh_process_on_the_cached_reference(
    cache_dir, tmp_path
):
    """method.kind full: the initial model's log-probabilities are computed once and cached with the data;
    the held-out accuracy rises, a run resumed in a fresh process (`python -m lorakit.run` on its
    recipe.yaml) reads the cache from disk and repeats the uninterrupted one, and lorakit.evaluate scores the
    finished run against the same cache."""
    recipe = _recipe(
        cache_dir,
        tmp_path / "run",
        "llama",
        method={"kind": "full"},
        train={"max_steps": 4, "lr": 1e-3},
        eval={"every": 2},
        checkpoint={"every": 2, "keep": 2},
        distributed={"num_processes": 1, "zero_stage": 3},
    )
    whole = lorakit.train(recipe)
    records = rundir.read_metrics(whole.run_dir)
    reference = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    # The policy starts as its reference: ln 2 up to the float noise of packed (policy) vs padded (reference)
    # rows.
    assert reference[0]["loss"] == pytest.approx(math.log(2), abs=1e-4)
    assert abs(reference[0]["margin"]) < 1e-3
    assert [e["step"] for e in evals] == [2, 4] and evals[-1]["accuracy"] > 90, evals
    weights = (whole.run_dir / "model" / "model.safetensors").read_bytes()
    tables = list(Path(whole.summary["data"]["cache_dir"], "reference").iterdir())
    assert len(tables) == 1
    written = tables[0].stat().st_mtime_ns
    # As if the run had stopped after step 2's checkpoint.
    found = complete_checkpoints(whole.run_dir)
    assert [c.step for c in found] == [2, 4]
    shutil.rmtree(found[-1].path)
    resumed = _relaunched(whole.run_dir)
    assert tables[0].stat().st_mtime_ns == written  # read, not computed again
    again = [r for r in rundir.read_metrics(resumed) if r["kind"] == "train"]
    keys = ("step", "loss", "grad_norm", *DPO_METRICS)
    assert [r["step"] for r in again] == [1, 2, 3, 4]
    flat = [r[k] for r in again for k in keys]
    assert flat == pytest.approx([r[k] for r in reference for k in keys], abs=1e-6)
    assert (resumed / "model" / "model.safetensors").read_bytes() == weights
    scored = lorakit.evaluate(resumed)
    assert scored.metrics == pytest.approx({k: evals[-1][k] for k in ("loss", *DPO_METRICS)}, abs=1e-4)


@pytest.mark.slow
def test_qlora_dpo_on_zero2_starts_at_its_reference_and_resumes_in_a_fresh_process_identically(
    cache_dir, tmp_path
):
    """QLoRA (4-bit base) on ZeRO-2 with shared-prompt rows: the reference is the 4-bit base with the adapter
    off, so the first step's loss is ln 2 (LoRA's B starts at zero, whatever the dropout); the run resumed
    from its step-2 checkpoint in a fresh process, LoRA dropout on, repeats the uninterrupted one and ends
    with the same adapter."""
    recipe = _recipe(
        cache_dir,
        tmp_path / "run",
        "llama",
        model={"dtype": "bfloat16"},
        method={"kind": "qlora", "dropout": DROPOUT},
        data={"max_eval_samples": 8},
        train={"max_steps": 4},
        eval={"every": 4},
        checkpoint={"every": 2, "keep": 2},
        distributed={"num_processes": 1, "zero_stage": 2},
    )
    whole = lorakit.train(recipe)
    assert whole.summary["method"] == "qlora" and whole.summary["zero_stage"] == 2
    reference = [r for r in rundir.read_metrics(whole.run_dir) if r["kind"] == "train"]
    assert reference[0]["loss"] == pytest.approx(math.log(2), abs=1e-5)
    assert reference[-1]["loss"] < reference[0]["loss"]
    adapter = _adapter(whole.run_dir)
    found = complete_checkpoints(whole.run_dir)
    assert [c.step for c in found] == [2, 4]
    shutil.rmtree(found[-1].path)
    resumed = _relaunched(whole.run_dir)
    again = [r for r in rundir.read_metrics(resumed) if r["kind"] == "train"]
    keys = ("step", "loss", "grad_norm", *DPO_METRICS)
    assert [r[k] for r in again for k in keys] == pytest.approx(
        [r[k] for r in reference for k in keys], abs=1e-6
    )
    again_adapter = _adapter(resumed)
    assert again_adapter.keys() == adapter.keys()
    assert all(torch.equal(again_adapter[k], adapter[k]) for k in adapter)


@pytest.mark.slow
@pytest.mark.parametrize("objective", ["orpo", "kto"])
def test_orpo_and_kto_on_zero3_two_processes_learn(two_process_runs, objective):
    steps = ALIGNMENT_STEPS[objective]
    run_dir = two_process_runs[0] / objective
    records = rundir.read_metrics(run_dir)
    train = [r for r in records if r["kind"] == "train"]
    evals = [r for r in records if r["kind"] == "eval"]
    # Halfway, the end, and (KTO's 160 rows) an epoch's end between.
    assert evals[0]["step"] == steps // 2 and evals[-1]["step"] == steps
    assert all(set(ALIGNMENT_KEYS[objective]) <= set(r) for r in train), train[0]
    if objective == "orpo":
        assert evals[-1]["accuracy"] > 80, evals
        assert train[-1]["nll"] < train[0]["nll"] and train[-1]["log_odds_ratio"] > train[0]["log_odds_ratio"]
    else:
        # LoRA's B starts at zero, so whatever the dropout, before the first update the policy is its
        # reference (rewards 0, loss 1/2 a row).
        assert train[0]["loss"] == pytest.approx(0.5, abs=1e-5) and train[0]["kl"] == 0.0
        assert 0 < evals[0]["margin"] < evals[-1]["margin"], evals
        assert 0.2 < evals[-1]["desirable_share"] < 0.8 and evals[-1]["rewards/undesirable"] < 0
    # `orpo lambda=0.1`, `kto beta=0.1`
    assert f"{objective} " in " ".join(rundir.read_summary(run_dir)["method_options"])


@pytest.mark.slow
@pytest.mark.parametrize("objective", list(RESUMED))
def test_a_preference_run_resumed_in_a_fresh_process_with_dropout_on_repeats_the_uninterrupted_run(
    two_process_runs, objective
):
    base, launch = two_process_runs
    name, steps = RESUMED[objective]
    whole, again = base / name, base / f"{objective}-resumed"
    finished(launch, again)
    assert rundir.read_summary(whole)["objective"] == rundir.read_summary(again)["objective"] == objective
    # As if the run had stopped after its middle checkpoint: the run resumed from it repeats every later step.
    found = [c.step for c in complete_checkpoints(whole)]
    assert found[0] == steps // 2 and found[-1] == steps  # (KTO: and its epoch's end, step 6)
    assert rundir.read_summary(again)["resumed_from"]["step"] == steps // 2
    later = [r for r in rundir.read_metrics(whole) if r["kind"] == "train" and r["step"] > steps // 2]
    resumed = [r for r in rundir.read_metrics(again) if r["kind"] == "train"]
    assert [r["step"] for r in resumed] == list(range(steps // 2 + 1, steps + 1))
    keys = ("step", "loss", "grad_norm", *RESUMED_KEYS[objective])
    assert [r[k] for r in resumed for k in keys] == pytest.approx(
        [r[k] for r in later for k in keys], abs=1e-6
    )
    adapter, again_adapter = _adapter(whole), _adapter(again)
    assert again_adapter.keys() == adapter.keys()
    assert all(torch.equal(again_adapter[k], adapter[k]) for k in adapter)
