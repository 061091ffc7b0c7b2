"""Metric records to tracking backends, best-evaluation bookkeeping, and the recipe keys that drive them."""

from __future__ import annotations

import sys
import time
from unittest import mock

import pytest

from lorakit.engine.best import BestPolicy, judge
from lorakit.engine.checkpoint import LoopState
from lorakit.errors import MissingExtraError, RecipeError
from lorakit.observe.plot import loss_curves
from lorakit.observe.records import flat_params, scalars
from lorakit.recipe import recipe_from_dict
from tests.conftest import tiny_recipe_dict
from tests.tracker_records import tensorboard_series


def test_a_record_becomes_kind_scoped_scalars_at_its_step():
    step, values = scalars(
        {
            "kind": "eval",
            "step": 7,
            "epoch": 0,
            "loss": 1.5,
            "rouge1": 20.0,
            "grad_norm": None,
            "skipped": True,
        }
    )
    assert step == 7
    assert values == {"eval/epoch": 0.0, "eval/loss": 1.5, "eval/rouge1": 20.0, "eval/skipped": 1.0}


def test_the_recipe_becomes_flat_parameters():
    flat = flat_params(
        {"train": {"lr": 0.1, "resume": "auto"}, "eval": {"metrics": ["rouge"], "every": None}}
    )
    assert flat == {
        "train.lr": 0.1,
        "train.resume": "auto",
        "eval.metrics": '["rouge"]',
        "eval.every": "null",
    }


def test_tensorboard_resume_purges_what_the_interrupted_run_logged_after_its_checkpoint(tmp_path):
    from lorakit.observe.tensorboard_sink import TensorBoardSink

    first = TensorBoardSink(tmp_path, params={"train": {"lr": 0.1}}, recipe_yaml="train:\n  lr: 0.1\n")
    for step in range(1, 6):
        first.write({"kind": "train", "step": step, "loss": float(step)})
    first.close()
    # Checkpoint at step 3; the killed run had logged 4 and 5, which the resumed run logs again. A resumed run
    # is a later process: its event file's name carries a later second. Made within the same second, the
    # names would order by the process's count of writers, as text ("...10" before "...9" on an xdist
    # worker that made 9 writers before: TensorBoard then read the resumed run first).
    later = time.time() + 2
    with mock.patch("time.time", lambda: later):
        resumed = TensorBoardSink(tmp_path, purge_step=4)
    for step in (4, 5, 6):
        resumed.write({"kind": "train", "step": step, "loss": 10.0 * step})
    resumed.close()
    # The recipe as hyper-parameters (HParams tab) and as text, written once by the fresh run.
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    acc = EventAccumulator(str(tmp_path))
    acc.Reload()
    assert acc.PluginTagToContent("hparams") and acc.Tags()["tensors"] == ["recipe/text_summary"]
    assert tensorboard_series(tmp_path, "train/loss") == [
        (1, 1.0),
        (2, 2.0),
        (3, 3.0),
        (4, 40.0),
        (5, 50.0),
        (6, 60.0),
    ]


def _judge_all(values, mode="min", patience=None, key="loss"):
    state, policy, out = LoopState(), BestPolicy(f"eval.{key}", mode, patience), []
    for step, value in enumerate(values, start=1):
        metrics = {} if value is None else {key: value}
        verdict = judge(state, policy, metrics, step, 0)
        out.append((verdict.improved, verdict.stop))
        if verdict.stop:
            break
    return state, out


def test_best_and_patience_count_evaluations_without_improvement():
    # A tie (2.0 after 2.0) is no improvement; an improvement resets the count.
    state, verdicts = _judge_all([3.0, 2.0, 2.5, 2.0, 1.0, 1.5, 1.2, 1.1, 0.5], patience=3)
    yes, no, stop = (True, False), (False, False), (False, True)
    assert verdicts == [yes, yes, no, no, yes, no, no, stop]
    assert state.best == {"metric": "eval.loss", "mode": "min", "value": 1.0, "step": 5, "epoch": 0}
    assert state.evals_since_best == 3


def test_max_mode_non_finite_values_and_evaluations_without_the_metric():
    state, verdicts = _judge_all([10.0, float("nan"), None, 12.0, 12.0], mode="max", key="rouge1", patience=3)
    # NaN never improves but counts; an evaluation without the metric (loss-only) neither improves nor counts.
    assert verdicts == [(True, False), (False, False), (False, False), (True, False), (False, False)]
    assert state.best["step"] == 4 and state.evals_since_best == 1


def test_a_changed_best_metric_starts_judging_over():
    state, _ = _judge_all([2.0, 3.0])
    assert state.best["value"] == 2.0 and state.evals_since_best == 1
    verdict = judge(state, BestPolicy("eval.rouge1", "max", 2), {"loss": 1.0, "rouge1": 5.0}, 3, 0)
    assert verdict.improved and state.best["metric"] == "eval.rouge1" and state.evals_since_best == 0


def _recipe(**sections):
    return recipe_from_dict(tiny_recipe_dict("/tmp/unused-cache", "/tmp/unused-out", **sections))


def test_best_metric_must_be_one_the_evaluation_produces():
    assert _recipe(checkpoint={"best_metric": "eval.rougeL"}).checkpoint.best_direction() == "max"
    assert _recipe(checkpoint={"best_metric": "eval.loss"}).checkpoint.best_direction() == "min"
    assert (
        _recipe(checkpoint={"best_metric": "eval.loss", "best_mode": "max"}).checkpoint.best_direction()
        == "max"
    )
    with pytest.raises(RecipeError, match="generation metrics need eval.generate"):
        _recipe(checkpoint={"best_metric": "eval.rouge1"}, eval={"generate": False})
    with pytest.raises(RecipeError, match="choose one of"):
        _recipe(checkpoint={"best_metric": "eval.accuracy"})
    with pytest.raises(RecipeError, match="needs evaluation"):
        _recipe(checkpoint={"best_metric": "eval.loss"}, eval={"enabled": False})


def test_early_stopping_needs_a_best_metric_and_eval_every_needs_evaluation():
    with pytest.raises(RecipeError, match="set checkpoint.best_metric"):
        _recipe(train={"early_stopping_patience": 2})
    with pytest.raises(RecipeError, match="eval.every needs evaluation"):
        _recipe(eval={"every": 2}, data={"eval_split": None})
    with pytest.raises(RecipeError, match="names a backend twice"):
        _recipe(output={"report_to": ["wandb", "wandb"]})
    assert _recipe().output.report_to == ["tensorboard"]
    assert _recipe(output={"report_to": []}).output.report_to == []


def test_a_missing_tracker_library_is_exit_2_before_any_work(monkeypatch, tmp_path):
    import lorakit

    monkeypatch.setitem(sys.modules, "wandb", None)  # `import wandb` raises ImportError
    out = tmp_path / "run"
    recipe = recipe_from_dict(tiny_recipe_dict(tmp_path / "cache", out, output={"report_to": ["wandb"]}))
    with pytest.raises(MissingExtraError, match=r'pip install "lorakit\[wandb\]"') as info:
        lorakit.train(recipe)
    assert info.value.exit_code == 2
    assert not out.exists() and not (tmp_path / "cache").exists()


def test_loss_curves_take_finite_train_and_eval_losses():
    records = [
        {"kind": "train", "step": 1, "loss": 2.0},
        {"kind": "train", "step": 2, "loss": float("nan")},
        {"kind": "eval", "step": 2, "loss": 1.5},
        {"kind": "train", "step": 3, "loss": 1.0},
    ]
    assert loss_curves(records) == {"train": ([1, 3], [2.0, 1.0]), "eval": ([2], [1.5])}
