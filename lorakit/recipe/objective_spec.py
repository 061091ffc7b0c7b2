"""What the recipe knows of a training objective: the pure-data ObjectiveSpec that `train.objective` names.

The objective itself (its loss, batching, reference pass, evaluation, planner extras) is a
lorakit.objectives.Objective, which carries its spec; the recipe, below it, validates against the specs and
settings models registered with it (lorakit.recipe.known_objectives), so checking a recipe never imports
torch.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class ObjectiveSpec:
    """A training objective as the recipe sees it: its name, what it refuses, what it reports. Its own
    settings, when it has any, are the recipe section of the same name (registered with the spec)."""

    name: str
    # Whole-recipe refusals: called with the validated Recipe, raises ValueError naming the field.
    check: Callable[[Any], None] | None = None
    # What its evaluation reports besides `loss` (means over its units): `eval.NAME` for
    # checkpoint.best_metric.
    eval_metrics: tuple[str, ...] = ()
    # Why model.tiled_loss (SFT's token cross-entropy over tiles, no logits) cannot compute its loss;
    # None: it can (and model.tiled_loss auto may tile it).
    no_tiled_loss: str | None = "computes its loss from the logits"
    # Why distributed.sequence_parallel > 1 cannot split its rows over ranks; None: it can.
    no_sequence_parallel: str | None = "needs each row whole on one rank"
    # lorakit.compare: the tag of a loss that is not SFT's token cross-entropy (train loss `x -> y (TAG)`,
    # eval loss as `TAG loss`), so unlike losses are never read as one quantity; None: the cross-entropy.
    loss_label: str | None = None


# The default objective's spec (train.objective's default; lorakit.objectives registers it as a built-in).
SFT = ObjectiveSpec(name="sft", no_tiled_loss=None, no_sequence_parallel=None)
