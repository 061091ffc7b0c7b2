"""One evaluation of a recipe's eval rows: the loss and generations of evaluate_model, the recipe's metrics
(compute_metrics) and, when the targets are label words, the classification report.

Training (lorakit.engine.job, after each epoch) and `python -m lorakit.evaluate` (a trained run on any split)
both evaluate through the run's objective, whose default evaluation (SFT's) is run_eval, so a run evaluated
again afterwards gets the numbers training recorded. An objective with its own evaluation (DPO's
preference pairs: lorakit.objectives.dpo) returns the same EvalOutcome.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from lorakit import dist
from lorakit.data.sources import SOURCE
from lorakit.evaluation.generate import auto_max_new_tokens, evaluate_model
from lorakit.recipe.schema import Recipe


@dataclass(frozen=True)
class EvalOutcome:
    """What one evaluation found. Every rank has the loss; the generation results are rank 0's only."""

    # loss, and when generating: the recipe's metrics (percent), plus `invalid` (percent of predictions
    # that are no label word) for classifiers; for a mixture, also each as "SOURCE/metric".
    metrics: dict[str, float]
    # In eval row order (rank 0, eval.generate); None otherwise.
    predictions: list[str] | None = None
    references: list[str] | None = None
    # lorakit.evaluation.classify.classification_report, when the data has label words (rank 0).
    classification: dict[str, Any] | None = None


def run_eval(
    engine, inputs, recipe: Recipe, data, tokenizer, collator, *, zero3: bool, generate: bool | None = None
) -> EvalOutcome:
    """Evaluate `engine` (a DeepSpeed engine, or anything with `.module`, `.device` and a forward) on the
    examples of `data.eval` (lorakit.data.PreparedData) with the recipe's eval settings: the token loss and,
    when generating, the recipe's metrics; every rank must call it.
    `generate`: whether to generate and score (default eval.generate; False takes the loss only)."""
    ev = recipe.eval
    generate = ev.generate if generate is None else generate
    # A mixture's eval rows keep their source's name: metrics per source too ("news/loss", "chats/rouge1").
    names = data.eval[SOURCE] if SOURCE in data.eval.column_names else []
    sources = list(names) if len(set(names)) > 1 else None
    out = evaluate_model(
        engine,
        inputs,
        data.eval,
        collator,
        tokenizer,
        batch_size=ev.micro_batch_size or recipe.train.micro_batch_size,
        generate=generate,
        max_new_tokens=auto_max_new_tokens(data) if ev.max_new_tokens == "auto" else ev.max_new_tokens,
        num_beams=ev.num_beams,
        zero3=zero3,
        groups=sources,
    )
    metrics = {"loss": out["loss"]}
    for name, (loss_sum, tokens) in out.get("group_loss", {}).items():
        metrics[f"{name}/loss"] = loss_sum / max(tokens, 1.0)
    if not generate:
        return EvalOutcome(metrics)
    # Rank 0 scores alone; on_main's agreement tells every rank at once when that fails (a metric that
    # raises), instead of leaving the others in the next collective until distributed.timeout_minutes.
    scored = dist.on_main("eval metrics", _score, ev, out, data, sources, metrics)
    return scored if scored is not None else EvalOutcome(metrics)


def _score(ev, out, data, sources, metrics) -> EvalOutcome:
    """Rank 0: the recipe's metrics of the generations, per source too, and the classification report."""
    from lorakit.evaluation.classify import classification_report
    from lorakit.evaluation.scoring import compute_metrics

    predictions, references = out["predictions"], list(data.eval["reference"])
    metrics.update(compute_metrics(list(ev.metrics), predictions, references))
    for name in sorted(set(sources or ())):
        rows = [i for i, s in enumerate(sources) if s == name]
        scores = compute_metrics(
            list(ev.metrics), [predictions[i] for i in rows], [references[i] for i in rows]
        )
        metrics.update({f"{name}/{metric}": value for metric, value in scores.items()})
    report = None
    labels = data.stats.get("labels")
    if labels:
        report = classification_report(predictions, references, labels)
        metrics["invalid"] = round(100.0 * report["invalid"] / report["examples"], 4)
    return EvalOutcome(metrics, predictions, references, report)
