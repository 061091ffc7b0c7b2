"""Watching and steering a run: evaluations every N steps, the tracking backends (TensorBoard, W&B offline,
an MLflow file store) read back with their own libraries, the best evaluation's weights, early stopping,
and all of it across a SIGTERM + resume. 2 processes, ZeRO-3: the uninterrupted runs in one torchrun launch
(qlora_worker.py), the SIGTERM + resume in real launches of `python -m lorakit.run`."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml

import lorakit
from lorakit import rundir
from tests.conftest import ROOT, tiny_recipe, tiny_recipe_dict
from tests.integration.qlora_worker import train_in_one_launch
from tests.integration.test_resume import launch
from tests.tracker_records import (
    mlflow_params,
    mlflow_series,
    tensorboard_series,
    wandb_config,
    wandb_series,
)

LR = 1e-7
EVAL_STEPS = [2, 4, 6]


def _train_losses(records) -> dict[int, float]:
    return {r["step"]: r["loss"] for r in records if r["kind"] == "train"}


def _evals(records) -> dict[int, dict]:
    return {r["step"]: {k: v for k, v in r.items() if k != "kind"} for r in records if r["kind"] == "eval"}


def _same_series(got: list[tuple[int, float]], expected: list[tuple[int, float]]) -> None:
    """The same steps, and values equal to float32 precision (TensorBoard stores float32)."""
    assert [step for step, _ in got] == [step for step, _ in expected]
    assert [v for _, v in got] == pytest.approx([v for _, v in expected], rel=1e-6)


def test_evaluations_do_not_change_training(cache_dir, tmp_path):
    # Dropout on: an evaluation that drew from the RNG streams would change the next steps' masks.
    common = {"method": {"dropout": 0.1}, "output": {"report_to": []}}
    train = {"max_steps": 5, "micro_batch_size": 4}
    with_evals = tiny_recipe(
        cache_dir,
        tmp_path / "evals",
        train=train,
        eval={"every": 1, "max_samples": 4, "max_new_tokens": 4},
        **common,
    )
    without = tiny_recipe(cache_dir, tmp_path / "plain", train=train, eval={"enabled": False}, **common)
    a = rundir.read_metrics(lorakit.train(with_evals).run_dir)
    b = rundir.read_metrics(lorakit.train(without).run_dir)
    assert sorted(_evals(a)) == [1, 2, 3, 4, 5] and not _evals(b)
    assert all("rouge1" in e for e in _evals(a).values())
    assert len(_train_losses(a)) == 5
    assert _train_losses(a) == _train_losses(b)  # exactly: same process, same kernels


def _plateau_recipe(cache_dir: Path, out: Path, path: Path) -> Path:
    """A run whose generations cannot change (lr 1e-7), so eval.rouge1 stops improving after the first
    evaluation and early stopping ends it at the third."""
    raw = tiny_recipe_dict(
        cache_dir,
        out,
        method={"dropout": 0.1},
        train={"max_steps": 8, "micro_batch_size": 2, "lr": LR, "early_stopping_patience": 2},
        distributed={"num_processes": 2, "zero_stage": 3},
        eval={"every": 2, "max_samples": 4, "max_new_tokens": 6},
        checkpoint={"best_metric": "eval.rouge1"},
        output={"report_to": ["tensorboard", "wandb", "mlflow"]},
    )
    path.write_text(yaml.safe_dump(raw))
    return path


def _plain_recipe(cache_dir: Path, out: Path) -> dict:
    """The plateau run without any evaluation (and so without best_metric and early stopping)."""
    raw = yaml.safe_load(_plateau_recipe(cache_dir, out, out.with_suffix(".yaml")).read_text())
    raw["eval"] = {"enabled": False}
    raw["checkpoint"], raw["output"]["report_to"] = {}, []
    del raw["train"]["early_stopping_patience"]
    return raw


@pytest.fixture(scope="module")
def runs(cache_dir, tmp_path_factory) -> dict[str, Path]:
    """The plateau run and the same run without evaluations, trained in order in one 2-process launch
    (lorakit.train on each worker, as `python -m lorakit.run` runs it): their run directories."""
    base = tmp_path_factory.mktemp("plateau")
    dirs = {"plateau": base / "run", "plain": base / "plain"}
    recipes = {
        base / "recipe.yaml": yaml.safe_load(
            _plateau_recipe(cache_dir, dirs["plateau"], base / "recipe.yaml").read_text()
        ),
        base / "plain.yaml": _plain_recipe(cache_dir, dirs["plain"]),
    }
    train_in_one_launch(recipes, {"PYTHONPATH": str(ROOT), "WANDB_MODE": "offline"})
    return dirs


@pytest.fixture(scope="module")
def plateau(runs) -> Path:
    return runs["plateau"]


@pytest.mark.slow
def test_every_tracker_receives_the_records_of_metrics_jsonl(plateau):
    records = rundir.read_metrics(plateau)
    train, evals = _train_losses(records), _evals(records)
    assert sorted(train) == list(range(1, 7)) and sorted(evals) == EVAL_STEPS
    summary = rundir.read_summary(plateau)
    where = summary["trackers"]
    assert set(where) == {"tensorboard", "wandb", "mlflow"} and where["wandb"]["mode"] == "offline"

    tb = Path(where["tensorboard"]["log_dir"])
    _same_series(tensorboard_series(tb, "train/loss"), sorted(train.items()))
    for name in ("loss", "rouge1"):
        expected = [(s, evals[s][name]) for s in EVAL_STEPS]
        _same_series(tensorboard_series(tb, f"eval/{name}"), expected)

    assert wandb_series(plateau, "train/loss") == train
    assert wandb_series(plateau, "eval/rouge1") == {s: evals[s]["rouge1"] for s in EVAL_STEPS}
    assert wandb_series(plateau, "train/lr") == {r["step"]: r["lr"] for r in records if r["kind"] == "train"}
    config = wandb_config(plateau)
    assert config["train"]["lr"] == LR and config["checkpoint"]["best_metric"] == "eval.rouge1"

    uri, run_id = where["mlflow"]["tracking_uri"], where["mlflow"]["run_id"]
    assert uri == (plateau / "mlruns").as_uri()
    assert mlflow_series(uri, run_id, "train/loss") == sorted(train.items())
    assert mlflow_series(uri, run_id, "eval/loss") == [(s, evals[s]["loss"]) for s in EVAL_STEPS]
    params = mlflow_params(uri, run_id)
    assert float(params["train.lr"]) == LR and params["checkpoint.best_metric"] == "eval.rouge1"


@pytest.mark.slow
def test_a_plateau_stops_early_and_keeps_the_best_adapter(plateau):
    summary = rundir.read_summary(plateau)
    evals = _evals(rundir.read_metrics(plateau))
    # lr 1e-7 changes no generation: rouge1 is flat, the first evaluation stays the best.
    assert len({evals[s]["rouge1"] for s in EVAL_STEPS}) == 1
    assert summary["stop_reason"] == "early_stopping" and summary["steps"] == 6
    best = summary["best"]
    assert (best["metric"], best["mode"], best["step"], best["evals_since"]) == ("eval.rouge1", "max", 2, 2)
    assert best["value"] == evals[2]["rouge1"]
    info = json.loads((plateau / "best" / rundir.BEST_INFO).read_text())
    assert info["step"] == 2 and info["eval"] == {
        k: v for k, v in evals[2].items() if k not in ("step", "epoch")
    }
    assert (plateau / "best" / "adapter_model.safetensors").stat().st_size > 0
    assert (plateau / "adapter" / "adapter_model.safetensors").is_file()
    assert (plateau / rundir.LOSS_PLOT).stat().st_size > 0


@pytest.mark.slow
def test_zero3_evaluations_on_every_rank_do_not_change_training(runs):
    plain, evaluated = (_train_losses(rundir.read_metrics(runs[k])) for k in ("plain", "plateau"))
    assert len(plain) == 8 and len(evaluated) == 6
    assert {step: plain[step] for step in evaluated} == evaluated


@pytest.mark.slow
def test_sigterm_and_resume_end_with_the_same_best_and_records(plateau, cache_dir, tmp_path):
    recipe = _plateau_recipe(cache_dir, tmp_path / "run", tmp_path / "recipe.yaml")
    run = tmp_path / "run"
    stopped = launch(recipe, fault="term:3", WANDB_MODE="offline")
    assert stopped.returncode == 75, stopped.stderr[-5000:]
    mlflow_run = json.loads((run / rundir.TRACKERS).read_text())["mlflow"]["run_id"]
    resumed = launch(recipe, WANDB_MODE="offline")
    assert resumed.returncode == 0, resumed.stderr[-5000:]

    summary, reference = rundir.read_summary(run), rundir.read_summary(plateau)
    assert summary["resumed_from"]["step"] == 3
    assert summary["stop_reason"] == reference["stop_reason"] == "early_stopping"
    drop_dir = lambda best: {k: v for k, v in best.items() if k != "dir"}  # noqa: E731
    assert drop_dir(summary["best"]) == pytest.approx(drop_dir(reference["best"]))

    records, ref_records = rundir.read_metrics(run), rundir.read_metrics(plateau)
    assert _train_losses(records) == pytest.approx(_train_losses(ref_records), abs=1e-6)
    evals, ref_evals = _evals(records), _evals(ref_records)
    assert sorted(evals) == sorted(ref_evals) == EVAL_STEPS
    for step in EVAL_STEPS:
        assert evals[step] == pytest.approx(ref_evals[step], abs=1e-6)
    # Every step once and in order in TensorBoard and MLflow; the same W&B and MLflow runs continued.
    tb = tensorboard_series(run / rundir.TENSORBOARD, "train/loss")
    assert [s for s, _ in tb] == list(range(1, 7))
    assert [s for s, _ in tensorboard_series(run / rundir.TENSORBOARD, "eval/rouge1")] == EVAL_STEPS
    where = summary["trackers"]
    assert where["mlflow"]["run_id"] == mlflow_run
    assert [s for s, _ in mlflow_series(where["mlflow"]["tracking_uri"], mlflow_run, "train/loss")] == list(
        range(1, 7)
    )
    assert sorted(wandb_series(run, "train/loss")) == list(range(1, 7))
    assert len({p.name.rsplit("-", 1)[-1] for p in (run / "wandb").glob("offline-run-*")}) == 1
