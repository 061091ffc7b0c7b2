"""Gradient checkpointing of the transformer blocks: off, selective (every k-th block) or whole.

Selective is layer-frequency checkpointing, as torchtitan's and torchtune's selective activation
checkpointing with an integer option: blocks 0, k, 2k, ... keep only their input and run again in the
backward; the others keep their activations. It composes with transformers' own switch
(`activation_checkpointing_enable(every_n_layers=k)`, transformers 5.x), which flags every k-th
GradientCheckpointingLayer of the model in module order (an encoder-decoder's encoder blocks, then its
decoder's), non-reentrant, so the recompute restores the RNG state and draws the same dropout masks.

Which mode a run uses is decided before the model is built: with model.gradient_checkpointing auto, by the
memory planner (lorakit.planner.checkpointing) from the run's shapes and GPU memory, handed to the job as
part of the plan; `from_plan` reads it back (a pure function of the plan and the recipe)."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

OFF, SELECTIVE, WHOLE = "off", "selective", "whole"
# Selective without a k in the recipe and nothing to plan against: half the blocks.
DEFAULT_EVERY = 2


@dataclass(frozen=True)
class Checkpointing:
    """The checkpointing a run uses: `mode` (off, selective, whole), `every` (selective: every k-th block)
    and `why` it was chosen (one line, for the console and summary.json)."""

    mode: str
    every: int | None = None
    why: str = ""

    @property
    def enabled(self) -> bool:
        """Whether any block is checkpointed."""
        return self.mode != OFF

    @property
    def every_n_blocks(self) -> int:
        """1 for whole, k for selective (meaningless when off)."""
        return self.every if self.mode == SELECTIVE and self.every else 1

    def label(self) -> str:
        """`off`, `whole` or `selective (every 2nd block)`."""
        if self.mode != SELECTIVE:
            return self.mode
        return f"selective (every {ordinal(self.every_n_blocks)} block)"

    def describe(self) -> str:
        """The console line."""
        return f"gradient checkpointing: {self.label()}: {self.why}"

    def to_dict(self) -> dict[str, Any]:
        """summary.json's and the plan's `gradient_checkpointing`."""
        return asdict(self)


def ordinal(n: int) -> str:
    """2nd, 3rd, 4th, 11th, 21st."""
    suffix = "th" if 10 <= n % 100 <= 20 else {1: "st", 2: "nd", 3: "rd"}.get(n % 10, "th")
    return f"{n}{suffix}"


def checkpointed_blocks(blocks: int, every: int, start: int = 0) -> int:
    """How many of `blocks` blocks, numbered from `start` in the model's module order, every-`every`-th
    checkpointing checkpoints (those whose number is a multiple of `every`)."""
    return len(range(-(-start // every) * every, start + blocks, every))


def from_recipe(model_section, why: str | None = None) -> Checkpointing:
    """The recipe's explicit choice; auto without a plan is whole (what the default was before auto: the
    memory-safe choice when there is no GPU memory to plan against)."""
    value = model_section.gradient_checkpointing
    if value == "auto":
        return Checkpointing(WHOLE, None, why or "auto without a GPU memory to plan against: every block")
    said = f"model.gradient_checkpointing: {str(value).lower()} in the recipe"
    if value == "selective":
        every = model_section.checkpoint_every or DEFAULT_EVERY
        return Checkpointing(SELECTIVE, every, why or said)
    return Checkpointing(WHOLE if value else OFF, None, said)


def planner_decides(model_section) -> bool:
    """Whether the recipe leaves the choice to the planner (auto, or selective without a k)."""
    value = model_section.gradient_checkpointing
    return value == "auto" or (value == "selective" and model_section.checkpoint_every is None)


def from_plan(plan: dict[str, Any], model_section) -> Checkpointing:
    """The checkpointing the planner chose for this run (its plan's `gradient_checkpointing`); the
    recipe's own choice when the plan has none (a model the planner does not know: auto is then whole)."""
    chosen = plan.get("gradient_checkpointing") if isinstance(plan, dict) else None
    if chosen:
        return Checkpointing(chosen["mode"], chosen.get("every"), chosen.get("why", ""))
    reason = plan.get("error") if isinstance(plan, dict) else None
    why = f"auto, and the planner gave no plan ({reason}): every block" if reason else None
    return from_recipe(model_section, why)


def enable_checkpointing(model, every: int = 1) -> None:
    """Non-reentrant activation checkpointing (what peft's LoRA needs: no input-grad hook) of every
    `every`-th block, by transformers' current name for it (`activation_checkpointing_enable`;
    `gradient_checkpointing_enable` is its deprecated alias in 5.x, which warns)."""
    enable = getattr(model, "activation_checkpointing_enable", None)
    if enable is not None:
        enable(activation_checkpointing_kwargs={"use_reentrant": False}, every_n_layers=every)
    elif every == 1:
        model.gradient_checkpointing_enable(gradient_checkpointing_kwargs={"use_reentrant": False})
    else:
        raise RuntimeError(
            "selective gradient checkpointing needs transformers' activation_checkpointing_enable "
            "(transformers 5.x)"
        )


def apply(model, choice: Checkpointing) -> None:
    """Turn on `choice`'s checkpointing of `model`'s blocks (nothing when it is off)."""
    if choice.enabled:
        enable_checkpointing(model, choice.every_n_blocks)
