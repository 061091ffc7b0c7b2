"""The recipe's train and checkpoint sections: optimisation, the objective, and resumable checkpoints."""

from __future__ import annotations

from typing import Literal

from pydantic import Field, ValidationInfo, field_validator

from lorakit.recipe.known_objectives import spec_named
from lorakit.recipe.section import Section


class TrainSection(Section):
    """Optimisation hyper-parameters."""

    epochs: int = Field(1, ge=1, description="Passes over the training data (ignored when max_steps is set).")
    max_steps: int | None = Field(None, ge=1, description="Optimizer steps to take; overrides epochs.")
    lr: float = Field(2e-4, gt=0, description="Peak learning rate.")
    weight_decay: float = Field(0.0, ge=0, description="AdamW weight decay.")
    warmup_ratio: float = Field(0.03, ge=0, lt=1, description="Fraction of steps spent warming up linearly.")
    lr_schedule: Literal["linear", "cosine", "constant"] = Field("linear", description="Decay after warmup.")
    max_grad_norm: float = Field(1.0, ge=0, description="Gradient clipping norm; 0 disables clipping.")
    micro_batch_size: int = Field(
        8,
        ge=1,
        description="Examples per process per forward pass (without packing; packed encoder-decoders "
        "without train.max_tokens: the examples packed into one row).",
    )
    max_tokens: int | None = Field(
        None,
        ge=1,
        description="With packing: the token budget of one packed micro-batch (one row per process per "
        "forward pass; the encoder row for encoder-decoders). Default for causal LMs: micro_batch_size x "
        "data.max_length, what a full padded micro-batch would hold. Encoder-decoders: unset, each row "
        "holds micro_batch_size random examples; set, rows are filled to this budget (and "
        "max_target_tokens) by a two-capacity multipack sampler, so which examples share an optimizer step "
        "depends on their lengths (docs/packing.md; with only max_target_tokens set, the budget is "
        "micro_batch_size x the mean source length / 0.95). A larger budget holds more examples per row: "
        "lower gradient_accumulation_steps to keep the step; docs/packing.md has measured budgets. "
        "Encoder-decoders that cannot pack (data.packing: auto on BART and the like): the source budget of a "
        "padded micro-batch of similar lengths (rows x longest), by default micro_batch_size examples on "
        "average.",
    )
    max_target_tokens: int | None = Field(
        None,
        ge=1,
        description="Encoder-decoders: the token budget of the decoder row (packed), or of a padded "
        "micro-batch's targets (rows x longest, when the model cannot pack). Default: max_tokens x "
        "the training data's target/source token ratio (at least its longest target), so both rows fill "
        "alike (the sampler packs under both budgets at once).",
    )
    gradient_accumulation_steps: int = Field(1, ge=1, description="Micro-batches per optimizer step.")
    seed: int = Field(42, description="Seed for model init, LoRA init, shuffling and dropout.")
    log_every: int = Field(1, ge=1, description="Write a metrics.jsonl line every this many steps.")
    on_nonfinite: Literal["error", "skip"] = Field(
        "error",
        description="A step whose loss or gradient norm is NaN or infinite. error: stop with a message naming "
        "the step (exit code 4), keeping the last checkpoint; skip: drop that step's update (weights, "
        "optimizer and learning-rate schedule unchanged) and count it in summary.json.",
    )
    max_skipped_steps: int = Field(
        10,
        ge=0,
        description="With on_nonfinite skip: stop as with error once more steps than this were skipped.",
    )
    early_stopping_patience: int | None = Field(
        None,
        ge=1,
        description="Stop training cleanly after this many evaluations in a row that did not improve "
        "checkpoint.best_metric (evaluations without that metric do not count); summary.json records "
        "stop_reason early_stopping. Needs checkpoint.best_metric. null: train for every planned step.",
    )
    # Imported by the loader of the caller's own recipe before validation, never by validation
    # (recipe/read_back.py: a recipe read back imports only what its caller allows).
    objective_module: str | None = Field(
        None,
        description="A Python module to import before train.objective is read, in this process and every "
        "worker the launcher starts: the one that registers a plugin objective (lorakit.objectives."
        "register), e.g. `mypkg.objectives`. null: only the built-in objectives.",
    )
    objective: str = Field(
        "sft",
        description="The training objective: sft (token-weighted cross-entropy on the targets) or another "
        "registered one: the preference objectives lorakit ships (docs/alignment.md) or one registered "
        "with lorakit.objectives.register (see train.objective_module). An objective with settings "
        "reads them from the top-level section of its name (its table below).",
    )
    resume: str = Field(
        "auto",
        description="auto: continue from the newest complete checkpoint in output.dir/checkpoints (see the "
        "checkpoint section) when there is one, so a relaunch of the same recipe picks up where it stopped; "
        "never: start fresh (existing checkpoints are moved to checkpoints/abandoned/); or the path of one "
        "checkpoint directory to resume from (an older step of this run's: newer ones are moved aside).",
    )

    @field_validator("objective")
    @classmethod
    def _known_objective(cls, name: str, info: ValidationInfo) -> str:
        spec_named(name)  # ValueError listing the known objectives
        return name


class CheckpointSection(Section):
    """Resumable checkpoints: DeepSpeed engine state (weights, optimizer, scheduler), sampler position, RNG
    states and loop counters, written atomically under output.dir/checkpoints. See docs/resume.md."""

    every: int | None = Field(
        None, ge=1, description="Save a checkpoint every this many optimizer steps; null: only at epoch ends."
    )
    at_epoch_end: bool = Field(True, description="Save a checkpoint at the end of every epoch.")
    keep: int = Field(2, ge=1, description="Keep the newest this many checkpoints; older ones are deleted.")
    best_metric: str | None = Field(
        None,
        description="Keep the adapter (full: the model) of the best evaluation so far in output.dir/best, "
        "judged by this metric: `eval.loss`, or with eval.generate a generation metric such as `eval.rouge1`, "
        "`eval.rougeL`, `eval.exact_match`, `eval.accuracy`. summary.json records the best step and value. "
        "null: no best checkpoint.",
    )
    best_mode: Literal["auto", "max", "min"] = Field(
        "auto",
        description="Whether a larger (max) or smaller (min) checkpoint.best_metric is better. auto: min for "
        "eval.loss, max for the generation metrics (percentages).",
    )

    def best_direction(self) -> str | None:
        """`min` or `max` for checkpoint.best_metric (best_mode, or what auto means for it); None without one."""
        if self.best_metric is None:
            return None
        if self.best_mode != "auto":
            return self.best_mode
        return "min" if self.best_metric == "eval.loss" else "max"
