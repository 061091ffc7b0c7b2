"""The Objective type: everything the rest of lorakit asks of a training objective (train.objective).

The loop (lorakit.engine.loop.train_window) asks an objective for `units(batch)`, the count its loss is a
sum over (target tokens for SFT, preference pairs for DPO), and for `loss(engine, inputs, batch, device)`:
the summed loss of the micro-batch and metric sums over the same units (detached tensors). The window's
units are summed over ranks before the first backward, so every objective's gradient is that of one batch
holding the whole window, as for token-weighted SFT.

Around the loop, the objective names the row layout it reads (`layout`: lorakit.data.layouts), from which
its rows are prepared and batched (prepare_data, make_batching),
what training needs before the first step (prepare_training: full fine-tuning DPO's reference
log-probabilities), how a run is evaluated (evaluation_data, evaluate), how summary.json names it
(method_options) and what the memory planner adds (plan_notes, describe_plan, and `passes`: the sequences and
reference pass it runs). Its `spec` (lorakit.recipe.objective_spec) is what the recipe knows: its name, section,
refusals and metrics.

The defaults are SFT's rows, batching and evaluation: an objective computing another loss over the same
rows overrides `units` and `loss` only. Adding one is a module with its subclass and `register(Cls)`
(lorakit.objectives.registry).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from lorakit.recipe.objective_spec import ObjectiveSpec

if TYPE_CHECKING:
    import torch

    from lorakit.data.batching import Batching
    from lorakit.data.prepare import PreparedData
    from lorakit.evaluation.runner import EvalOutcome


@dataclass(frozen=True)
class Passes:
    """What one micro-batch of an objective runs, as the memory planner counts it (Objective.passes)."""

    # Sequences each example puts in the forward with grad: SFT 1; a preference pair 2 (chosen,
    # rejected); a KTO row 2 (its completion, a mismatched one for the KL estimate). Encoder-decoders run
    # the prompt once and the decoder this many times.
    sequences: int = 1
    # The reference pass: "live", a no-grad forward of the same rows before each policy forward (the
    # adapter off); "before training", one no-grad pass over the data before the first step whose results
    # are cached (full fine-tuning); None: no reference model.
    reference: Literal["live", "before training"] | None = None

    @property
    def no_grad_forward(self) -> bool:
        """Whether a no-grad forward of a micro-batch's size runs (live, or the pass before training)."""
        return self.reference is not None


class Objective(ABC):
    """A training objective: its loss and divisor, its rows, its reference pass, evaluation and metrics."""

    spec: ClassVar[ObjectiveSpec]
    # The row layout it reads (lorakit.data.layouts): "examples" (SFT's), "pairs", "unpaired". Preparing
    # and batching its rows follow from it (prepare_data, make_batching).
    layout: ClassVar[str] = "examples"

    @property
    def name(self) -> str:
        """The train.objective this objective is registered under."""
        return self.spec.name

    @classmethod
    def from_recipe(cls, recipe, config) -> Objective:
        """The objective for `recipe` on a model of `config` (encoder-decoder or causal)."""
        return cls()

    # Training ------------------------------------------------------------------------------------------

    @abstractmethod
    def units(self, batch: dict[str, Any]) -> int:
        """The count the micro-batch's summed loss is a sum over (its share of the window's divisor)."""

    @abstractmethod
    def loss(
        self, engine, inputs, batch: dict[str, Any], device
    ) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
        """(summed loss with grad, {metric: detached sum over the same units})."""

    def step_metrics(self, sums: dict[str, float], units: float) -> dict[str, float]:
        """A step's metrics from the window's metric sums over every rank (`units`: its divisor). Default:
        each sum over the units."""
        return {k: v / max(units, 1.0) for k, v in sums.items()}

    def step_source(self, recipe, loader, tokenizer, engine, *, rank: int, world: int):
        """The StepSource the loop trains on when it is not the static windows of `loader` (None: it is).
        Called before the engine starts (`engine` None: only its plan is read) and again with it."""
        return None

    def prepare_training(self, recipe, engine, inputs, source: str, data, collator):
        """`data` (PreparedData) as training needs it, before any step or checkpoint load; every rank
        calls it. Default: `data` itself."""
        return data

    # Rows ----------------------------------------------------------------------------------------------

    @classmethod
    def prepare_data(cls, recipe, tokenizer, config) -> PreparedData:
        """Load, tokenize and cache the recipe's rows in this objective's row layout (lorakit.data.prepare).
        An objective names its layout (`layout`); it does not override this."""
        from lorakit.data.prepare import prepare_data

        return prepare_data(recipe, tokenizer, config, cls.layout)

    @classmethod
    def make_batching(cls, recipe, data, tokenizer, config, **how) -> Batching:
        """Sampler and collators for this objective's rows, chosen from its layout's lengths and collators
        (lorakit.data.batching.make_batching, which says what `how` holds: packing, world, rank,
        share_prompt_problem)."""
        from lorakit.data.batching import make_batching

        return make_batching(recipe, data, tokenizer, config, layout=cls.layout, **how)

    # Evaluation ----------------------------------------------------------------------------------------

    @classmethod
    def evaluation_data(cls, recipe, source: str, data):
        """`data` as `python -m lorakit.evaluate` scores a trained run on it (default: `data` itself)."""
        return data

    def evaluate(
        self, engine, inputs, recipe, data, tokenizer, collator, *, zero3: bool, generate: bool | None = None
    ) -> EvalOutcome:
        """One evaluation of `data.eval`; every rank calls it (default: SFT's loss and generation metrics,
        lorakit.evaluation.runner.run_eval, with the same arguments)."""
        from lorakit.evaluation.runner import run_eval

        return run_eval(engine, inputs, recipe, data, tokenizer, collator, zero3=zero3, generate=generate)

    # Run summary and memory plan -----------------------------------------------------------------------

    @classmethod
    def method_options(cls, recipe) -> list[str]:
        """What summary.json's method_options add for this objective (lorakit.compare shows them)."""
        return []

    @classmethod
    def run_summary(cls, recipe, records: list[dict[str, Any]]) -> dict[str, Any] | None:
        """summary.json's `objective_metrics`, from the run's metric records (None: nothing to add)."""
        return None

    @classmethod
    def plan_notes(cls, recipe) -> list[str]:
        """The planner's notes on what this objective adds to a micro-batch."""
        return []

    @classmethod
    def passes(cls, recipe) -> Passes:
        """The planner hook: the sequences and reference pass one micro-batch of `recipe` runs (default:
        SFT's, one sequence per example and no reference pass)."""
        return Passes()

    @classmethod
    def describe_plan(cls, no_grad_forward: str) -> str | None:
        """The plan report's line on this objective's activations (`no_grad_forward`: its size, formatted);
        None: nothing to add."""
        return None
