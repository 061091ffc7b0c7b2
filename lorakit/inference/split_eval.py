"""lorakit.evaluate: a trained run's metrics on any split of its data, computed as training computes them.

The run's recipe (with overrides) prepares the split through its objective (lorakit.objectives), so its rows
are tokenized and capped exactly as training's eval rows were (the caps come from the training split), and
the objective's evaluation scores them, the one training's evaluation calls. The model runs in
this process without DeepSpeed, its parameters in the dtype DeepSpeed's engine held them in (see
lorakit.inference.model.load_model), so the run's own eval split gives the numbers in its summary.json.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Collection, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from lorakit import rundir
from lorakit.errors import InferenceError, RecipeError
from lorakit.inference.model import Trained, find_trained, load_model
from lorakit.recipe import Recipe
from lorakit.recipe.read_back import read_back_recipe

EVALUATE_DOC = "docs/inference.md#evaluating-a-run-on-any-split"


@dataclass(frozen=True)
class EvaluateResult:
    """What lorakit.evaluate returns: the metrics and where the report went."""

    metrics: dict[str, float]
    split: str
    held_out: bool
    rows: int
    output: Path
    # Everything written to `output`: source, split, recipe overrides, metrics, classification, versions.
    report: dict[str, Any]


def _say(line: str) -> None:
    print(line, file=sys.stderr, flush=True)


def evaluation_recipe(
    trained: Trained,
    split: str | None,
    overrides: Sequence[str],
    *,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    allow_code: Collection[str] = (),
) -> Recipe:
    """The run's recipe with `overrides` applied, evaluation on, and data.eval_split set to `split` (then
    without data.val_size: a named split replaces the held-out rows); None keeps the run's eval split.
    Read back as data (recipe/read_back.py): trust and code (data.transform too: the data is read) only as
    the caller grants them."""

    def adjust(raw: dict) -> None:
        raw.setdefault("eval", {})["enabled"] = True
        if split is not None:
            raw.setdefault("data", {}).update(eval_split=split, val_size=None)

    where = trained.run_dir / rundir.RECIPE
    grants = {"trust_remote_code": trust_remote_code, "allow_pickle": allow_pickle, "allow_code": allow_code}
    recipe = read_back_recipe(
        where.read_text(), str(where), overrides=overrides, reads_data=True, adjust=adjust, **grants
    )
    if recipe.data.eval_split is None:
        raise RecipeError(
            "data.eval_split is null in the run's recipe: name the split to evaluate with --split",
            doc=EVALUATE_DOC,
        )
    return recipe


def report_path(trained: Trained, split: str, held_out: bool) -> Path:
    """RUN/evaluate-SPLIT.json (a held-out eval: SPLIT-held-out), with the artefact's name for any model
    directory other than the run's own adapter/ or model/ (RUN/merged: evaluate-merged-SPLIT.json)."""
    name = re.sub(r"[^\w.-]+", "_", split) + ("-held-out" if held_out else "")
    artefact = trained.source.path.name
    if artefact not in (rundir.ADAPTER, rundir.MODEL):
        name = f"{artefact}-{name}"
    return trained.run_dir / f"evaluate-{name}.json"


def evaluate(
    source: str | Path,
    split: str | None = None,
    overrides: Sequence[str] = (),
    *,
    output: str | Path | None = None,
    device: str | None = None,
    trust_remote_code: bool = False,
    allow_pickle: bool = False,
    allow_code: Collection[str] = (),
) -> EvaluateResult:
    """Evaluate the trained model at `source` (a run directory, or a directory inside one: adapter/,
    model/, merged/) on `split` of its data (default: the run's own eval split) with the run's recipe and
    dotted `overrides` (e.g. data.max_eval_samples=null, eval.num_beams=4).

    Writes the report to `output` (default RUN/evaluate-SPLIT.json), its predictions beside it
    (...-predictions.jsonl) and, for classifier runs, its confusion matrix (...-confusion_matrix.png).
    trust_remote_code, allow_pickle, allow_code: the caller's grants (the run's recipe is data).
    Raises InferenceError / RecipeError / DataError for bad input, before any model is loaded."""
    from lorakit.data.collate import padded_collator
    from lorakit.data.sources import eval_source
    from lorakit.model import load_config, load_tokenizer
    from lorakit.objectives import make_objective, objective_type

    trust = dict(trust_remote_code=trust_remote_code, allow_pickle=allow_pickle, allow_code=allow_code)
    trained = find_trained(source, **trust)
    if trained.run_dir is None:
        raise InferenceError(
            f"{source}: not a run directory or a directory inside one (no recipe.yaml here or in its parent); "
            "evaluate needs the run's recipe to prepare its data",
            doc=EVALUATE_DOC,
        )
    recipe = evaluation_recipe(trained, split, overrides, **trust)
    split_name, held_out = eval_source(recipe.data)
    out = (
        Path(output).expanduser().resolve()
        if output is not None
        else report_path(trained, split_name, held_out)
    )
    base, config = load_config(recipe)
    tokenizer = load_tokenizer(recipe, base)
    objective = objective_type(recipe)
    data = objective.evaluation_data(recipe, base, objective.prepare_data(recipe, tokenizer, config))
    _say(data.describe())
    if data.eval is None or len(data.eval) == 0:
        raise InferenceError(f"split {split_name!r}: no rows to evaluate", doc=EVALUATE_DOC)
    _say(f"evaluate: {len(data.eval)} row(s) of {split_name!r} with the {trained.describe()}")
    model = load_model(trained, recipe=recipe, device=device, tokenizer=tokenizer)
    _say(f"model:    {model.dtype} on {model.device}")
    outcome = make_objective(recipe, config).evaluate(
        model, model.inputs, recipe, data, tokenizer, padded_collator(tokenizer, config), zero3=False
    )
    report = {
        "source": str(trained.source.path),
        "run_dir": str(trained.run_dir),
        "split": split_name,
        "held_out": held_out,
        "rows": len(data.eval),
        "overrides": list(overrides),
        "metrics": outcome.metrics,
        "classification": outcome.classification,
        "data_cache": str(data.path),
        "versions": rundir.versions(),
    }
    _write(out, report, outcome)
    return EvaluateResult(outcome.metrics, split_name, held_out, len(data.eval), out, report)


def _write(out: Path, report: dict[str, Any], outcome) -> None:
    from lorakit.evaluation.classify import plot_confusion_matrix
    from lorakit.inference.generation import to_jsonl

    out.parent.mkdir(parents=True, exist_ok=True)
    stem = out.with_suffix("")
    if outcome.predictions is not None:
        pairs = zip(outcome.predictions, outcome.references, strict=True)
        records = [{"prediction": p, "reference": r} for p, r in pairs]
        rundir.write_text(Path(f"{stem}-predictions.jsonl"), to_jsonl(records))
    if outcome.classification is not None:
        plot_confusion_matrix(outcome.classification, Path(f"{stem}-confusion_matrix.png"), title=out.stem)
    # Last, so a report on disk means its companions are there too.
    rundir.write_json(out, report)
