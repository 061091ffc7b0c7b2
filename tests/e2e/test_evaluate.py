"""lorakit.evaluate and python -m lorakit.evaluate: a trained run scored on any split of its data by the code
training evaluates with; on the run's own eval split it gives the numbers of its summary.json."""

import json

import pytest

import lorakit
from lorakit import rundir
from lorakit.errors import RecipeError
from tests.conftest import run_cli
from tests.e2e.test_quickstart import noise_lines


def evaluate_cli(*args):
    # Fresh: its console is checked for what the imports print too.
    return run_cli("lorakit.evaluate", *args, timeout=300, fresh=True)


def test_evaluate_reproduces_the_training_eval(mnli_run):
    trained = rundir.read_summary(mnli_run)["eval"]
    result = lorakit.evaluate(mnli_run / "adapter")  # a directory inside the run finds the run's recipe
    assert result.split == "validation_mismatched" and not result.held_out and result.rows == 24
    assert set(result.metrics) == set(trained) == {"loss", "accuracy", "invalid"}
    assert result.metrics["loss"] == pytest.approx(trained["loss"], rel=1e-4)
    assert (
        result.metrics["accuracy"] == trained["accuracy"] and result.metrics["invalid"] == trained["invalid"]
    )
    assert result.output == mnli_run / "evaluate-validation_mismatched.json"
    report = json.loads(result.output.read_text())
    assert report["metrics"] == result.metrics and report["rows"] == 24
    assert (
        report["classification"]["confusion_matrix"]
        == rundir.read_summary(mnli_run)["classification"]["confusion_matrix"]
    )
    predictions = (mnli_run / "evaluate-validation_mismatched-predictions.jsonl").read_text().splitlines()
    assert predictions == (mnli_run / "eval_predictions.jsonl").read_text().splitlines()
    assert (mnli_run / "evaluate-validation_mismatched-confusion_matrix.png").read_bytes()[:4] == b"\x89PNG"


def test_a_bad_override_is_a_recipe_error(mnli_run):
    with pytest.raises(RecipeError, match="eval.num_beam: unknown key"):
        lorakit.evaluate(mnli_run, "validation_matched", ["eval.num_beam=2"])


def test_cli_evaluates_another_split_with_overrides_and_exits_2_without_a_recipe(mnli_run, mnli_merged):
    proc = evaluate_cli(mnli_run, "--split", "validation_matched", "data.max_eval_samples=8")
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads((mnli_run / "evaluate-validation_matched.json").read_text())
    assert report["split"] == "validation_matched" and report["rows"] == 8
    assert report["overrides"] == ["data.max_eval_samples=8"]
    assert f"accuracy={report['metrics']['accuracy']:.4f}" in proc.stdout and noise_lines(proc) == []

    proc = evaluate_cli(mnli_merged)  # an export outside its run: no run directory to take data from
    assert proc.returncode == 2 and "not a run directory" in proc.stderr and "Traceback" not in proc.stderr
    assert not list(mnli_merged.glob("evaluate-*"))
