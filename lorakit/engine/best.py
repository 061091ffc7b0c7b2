"""The best evaluation so far and early stopping (checkpoint.best_metric, train.early_stopping_patience).

Pure bookkeeping on the LoopState, so it is saved in every checkpoint and a resumed run judges the next
evaluation exactly as the uninterrupted run would. Every rank judges the same metrics (the job broadcasts
rank 0's, which alone has the generation metrics), so every rank takes the same collective actions.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

EARLY_STOPPING = "early_stopping"


@dataclass(frozen=True)
class BestPolicy:
    """What is best and what happens then: `metric` (`eval.loss`, `eval.rouge1`, ...), `mode` (min or
    max), `patience` (evaluations without improvement before stopping; None: never stop), and `save`,
    which writes the current weights as the best (collective)."""

    metric: str
    mode: str
    patience: int | None = None
    save: Callable[[], Any] | None = None

    @property
    def key(self) -> str:
        """The metric's name in an evaluation's metrics (`loss` for `eval.loss`)."""
        return self.metric.removeprefix("eval.")


@dataclass(frozen=True)
class Verdict:
    """What one evaluation meant: whether it is the new best, and whether training should stop."""

    improved: bool
    stop: bool


def better(value: float, than: float | None, mode: str) -> bool:
    """Whether `value` beats `than` (None: nothing yet) under `mode`; a non-finite value never does."""
    if not math.isfinite(value):
        return False
    if than is None:
        return True
    return value < than if mode == "min" else value > than


def judge(state, policy: BestPolicy, metrics: dict[str, Any], step: int, epoch: int) -> Verdict:
    """Update `state` (a LoopState: `best`, `evals_since_best`) with one evaluation's `metrics` at `step`.
    An evaluation without the metric (a loss-only eval with eval.generate_at epoch_end) neither improves
    nor counts towards the patience."""
    value = metrics.get(policy.key)
    if not isinstance(value, int | float):
        return Verdict(False, False)
    if state.best is not None and (state.best["metric"], state.best["mode"]) != (policy.metric, policy.mode):
        # A relaunch may change checkpoint.best_metric (it does not shape training): a value of another
        # metric or direction is no yardstick, so judging starts over.
        state.best, state.evals_since_best = None, 0
    previous = state.best["value"] if state.best else None
    if better(float(value), previous, policy.mode):
        state.best = {
            "metric": policy.metric,
            "mode": policy.mode,
            "value": float(value),
            "step": step,
            "epoch": epoch,
        }
        state.evals_since_best = 0
        return Verdict(True, False)
    state.evals_since_best += 1
    stop = policy.patience is not None and state.evals_since_best >= policy.patience
    return Verdict(False, stop)
