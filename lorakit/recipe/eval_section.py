"""The recipe's eval section: evaluation during training."""

from __future__ import annotations

from collections.abc import Mapping
from types import MappingProxyType
from typing import Literal

from pydantic import Field, field_validator

from lorakit.recipe.section import Section

# The flat keys each generation metric of eval.metrics reports, in order (lorakit.evaluation.scoring
# computes them; the recipe names them for checkpoint.best_metric).
METRIC_KEYS: Mapping[str, tuple[str, ...]] = MappingProxyType(
    {
        "rouge": ("rouge1", "rouge2", "rougeL", "rougeLsum"),
        "exact_match": ("exact_match",),
        "accuracy": ("accuracy",),
    }
)


def metric_keys(name: str) -> tuple[str, ...]:
    """The result keys metric `name` reports (rouge: rouge1, rouge2, rougeL, rougeLsum)."""
    return METRIC_KEYS[name]


class EvalSection(Section):
    """Evaluation during training, after each epoch and every eval.every steps: loss, and generation
    metrics. See docs/observe.md."""

    enabled: bool = Field(
        True, description="Evaluate after each epoch and every eval.every steps (needs data.eval_split)."
    )
    every: int | None = Field(
        None,
        ge=1,
        description="Also evaluate every this many optimizer steps (every rank takes part, as at epoch "
        "ends). null: only at epoch ends. An evaluation never changes training: the same losses follow.",
    )
    max_samples: int | None = Field(
        None,
        ge=1,
        description="Evaluate on the first this many eval rows during training (after data.max_eval_samples), "
        "to keep frequent evaluations cheap; `python -m lorakit.evaluate` afterwards uses every row. null: "
        "all rows.",
    )
    generate_at: Literal["every_eval", "epoch_end"] = Field(
        "every_eval",
        description="With eval.generate: which evaluations generate and score predictions. every_eval: all "
        "of them; epoch_end: only those at epoch ends (the eval.every ones take the loss only, much cheaper).",
    )
    metrics: list[Literal["rouge", "exact_match", "accuracy"]] = Field(
        ["rouge"], description="Generation metrics: rouge (summaries), exact_match/accuracy (labels)."
    )
    generate: bool = Field(True, description="Generate predictions for the metrics (else loss only).")
    max_new_tokens: int | Literal["auto"] = Field(
        "auto", description="Generation length cap; auto: data.max_target_length."
    )
    num_beams: int = Field(1, ge=1, description="Beam search width for generation.")
    micro_batch_size: int | None = Field(None, ge=1, description="Eval batch size; default train's.")

    @field_validator("max_new_tokens")
    @classmethod
    def _positive_length(cls, value: int | str) -> int | str:
        # Generating zero new tokens scores every prediction as empty.
        if isinstance(value, int) and value < 1:
            raise ValueError("must be >= 1 or 'auto'")
        return value
