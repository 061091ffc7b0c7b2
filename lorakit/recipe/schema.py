"""THE recipe schema: the Recipe and its cross-section checks. Every key, type, default and check lives in
this package, one module per section (model_section.py, method.py, data_section.py, train_section.py with
checkpoint, distributed_section.py with fsdp_section.py, eval_section.py, output_section.py with preflight),
except the sections of the objectives: each registered objective with settings adds the top-level section of
its name, validated by its own model (known_objectives.py; the built-ins' are in lorakit.objectives).
docs/recipes.md is generated from them (reference.py). Every section and name stays importable from here.

A recipe is frozen after validation; values derived from it are functions, not stored fields.
"""

from __future__ import annotations

from pydantic import ConfigDict, ValidationError, model_validator

from lorakit.recipe.data_section import DataSection, SourceSpec, data_parts
from lorakit.recipe.distributed_section import ZERO_PLUS_PLUS, DistributedSection, check_backend
from lorakit.recipe.eval_section import EvalSection, metric_keys
from lorakit.recipe.fsdp_section import FsdpSection
from lorakit.recipe.known_objectives import (
    check_objective,
    objective_sections,
    spec_of,
)
from lorakit.recipe.method import MethodSection
from lorakit.recipe.model_section import ModelSection
from lorakit.recipe.output_section import REPO_ID_PATTERN, OutputSection, PreflightSection, PushToHubSection
from lorakit.recipe.section import Section, placeholders
from lorakit.recipe.train_section import CheckpointSection, TrainSection

__all__ = [
    "CheckpointSection",
    "DataSection",
    "DistributedSection",
    "EvalSection",
    "FsdpSection",
    "MethodSection",
    "ModelSection",
    "OutputSection",
    "PushToHubSection",
    "PreflightSection",
    "REPO_ID_PATTERN",
    "Recipe",
    "SourceSpec",
    "TrainSection",
    "ZERO_PLUS_PLUS",
    "data_parts",
    "placeholders",
]


class Recipe(Section):
    """A complete, validated, frozen training recipe. Besides its declared sections it holds the section of
    each registered objective the recipe gives (and its own objective's, defaults filled in), validated by
    that objective's settings model: `recipe.NAME`, or known_objectives.section_of(recipe)."""

    # extra keys are allowed only as registered objectives' sections (_objective_sections refuses the rest).
    model_config = ConfigDict(extra="allow", frozen=True, validate_default=True, allow_inf_nan=False)

    model: ModelSection
    method: MethodSection = MethodSection()
    data: DataSection
    train: TrainSection = TrainSection()
    distributed: DistributedSection = DistributedSection()
    eval: EvalSection = EvalSection()
    checkpoint: CheckpointSection = CheckpointSection()
    output: OutputSection
    preflight: PreflightSection = PreflightSection()

    @model_validator(mode="wrap")
    @classmethod
    def _objective_sections(cls, data, handler):
        # Before the declared sections (and the checks across them, which may read an objective's
        # section): every other key is validated as a registered objective's section or refused; the
        # errors of both are reported together.
        if not isinstance(data, dict):
            return handler(data)
        train = data.get("train")
        given = train if isinstance(train, dict) else {}
        # Validation imports nothing (docs/faults.md#recipes-read-back-are-data): the caller's own recipe had
        # its train.objective_module imported by the loader before this runs (recipe/load.py), so a plugin's
        # section is registered by now; a recipe read back names no code the caller did not grant.
        objective = getattr(
            train, "objective", given.get("objective", TrainSection.model_fields["objective"].default)
        )
        data, problems = objective_sections(data, cls.model_fields, objective)
        try:
            recipe = handler(data)
        except ValidationError as e:
            problems = [_line(line) for line in e.errors()] + problems
            raise ValidationError.from_exception_data(cls.__name__, problems) from None
        if problems:
            raise ValidationError.from_exception_data(cls.__name__, problems)
        return recipe

    @model_validator(mode="after")
    def _check(self) -> Recipe:
        if self.data.format == "completion" and self.eval_active() and self.eval.generate:
            raise ValueError(
                "eval.generate: data.format completion has no reference outputs to score generations "
                "against; set eval.generate: false (the eval loss is still computed)"
            )
        if self.eval.enabled and self.eval.generate and not self.eval.metrics:
            raise ValueError(
                "eval.metrics is empty while eval.generate is true: name a metric or set generate: false"
            )
        if self.output.tracker_timeout_seconds >= self.distributed.timeout_minutes * 60:
            # The other ranks wait for rank 0's trackers to start and to close at a collective.
            raise ValueError(
                "output.tracker_timeout_seconds must be shorter than distributed.timeout_minutes: the other "
                "processes wait for rank 0's trackers at a collective, which would time out first and fail the run"
            )
        self._check_sequence_parallel()
        # The sharding backend's own checks (lorakit.backends: DeepSpeed's, FSDP2's).
        check_backend(self)
        check_objective(self)
        self._check_best()
        return self

    def _check_sequence_parallel(self) -> None:
        objective = spec_of(self)
        if self.model.tiled_loss is True and objective.no_tiled_loss is not None:
            raise ValueError(
                f"model.tiled_loss: true tiles the token cross-entropy of SFT; train.objective {objective.name} "
                f"{objective.no_tiled_loss}: set model.tiled_loss: auto or false"
            )
        if self.distributed.sequence_parallel == 1:
            return
        if self.model.attention == "eager":
            raise ValueError(
                "distributed.sequence_parallel > 1 needs model.attention sdpa, flash_attention_2 or auto: "
                "eager attention over a split row would need the whole row's T x T mask on every rank"
            )
        if self.data.packing is False:
            raise ValueError(
                "distributed.sequence_parallel > 1 splits packed rows: set data.packing: auto or true"
            )
        if objective.no_sequence_parallel is not None:
            raise ValueError(
                f"distributed.sequence_parallel > 1 splits SFT rows; train.objective {objective.name} "
                f"{objective.no_sequence_parallel}: use distributed.sequence_parallel 1 with {objective.name}"
            )

    def _check_best(self) -> None:
        ck, ev = self.checkpoint, self.eval
        if ev.every is not None and not self.eval_active():
            raise ValueError(
                "eval.every needs evaluation: eval.enabled true and a data.eval_split (or remove eval.every)"
            )
        if ck.best_metric is not None:
            if not self.eval_active():
                raise ValueError(
                    f"checkpoint.best_metric {ck.best_metric!r} needs evaluation: eval.enabled true and a "
                    "data.eval_split"
                )
            produced = self.eval_metric_names()
            if ck.best_metric not in produced:
                raise ValueError(
                    f"checkpoint.best_metric {ck.best_metric!r} is not a metric this recipe's evaluation "
                    f"produces; choose one of {sorted(produced)}"
                    + ("" if ev.generate else " (generation metrics need eval.generate: true)")
                )
        if self.train.early_stopping_patience is not None and ck.best_metric is None:
            raise ValueError(
                "train.early_stopping_patience counts evaluations without improvement of "
                "checkpoint.best_metric: set checkpoint.best_metric (e.g. eval.loss)"
            )

    def eval_metric_names(self) -> set[str]:
        """`eval.NAME` for every metric this recipe's in-run evaluation reports: loss, and with eval.generate
        the keys of eval.metrics (rouge: rouge1, rouge2, rougeL, rougeLsum), and its objective's own metrics
        (a preference objective's rewards, margin, accuracy)."""
        names = {"eval.loss"} | {f"eval.{key}" for key in spec_of(self).eval_metrics}
        if self.eval.generate:
            names |= {f"eval.{key}" for name in self.eval.metrics for key in metric_keys(name)}
        return names

    def eval_active(self) -> bool:
        """Whether the run evaluates (evaluation enabled and an eval split given)."""
        return self.eval.enabled and self.data.eval_split is not None


def _line(error: dict) -> dict:
    """A pydantic error as a line error ValidationError.from_exception_data takes."""
    line = {"type": error["type"], "loc": error["loc"], "input": error.get("input")}
    if error.get("ctx"):
        line["ctx"] = error["ctx"]
    return line
