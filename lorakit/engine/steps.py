"""Where the training loop's steps come from: a `StepSource` yields each optimizer step's micro-batches (a
`Window`) epoch by epoch, with the position after it, which the loop keeps in its LoopState and so in every
checkpoint. A resumed run hands the saved position back and gets exactly the windows the interrupted run had
next.

`StaticSteps` is the source of a fixed dataset: the DataLoader over a ResumableBatchSampler, grouped into
accumulation windows; its order is a pure function of (seed, epoch), so its position is a number of
micro-batches. A source that makes its steps as training goes (rollouts: generate with the current weights
through Engine.generate, score, batch) is another implementation; what it holds that a position cannot
rebuild (its own random generator, rollouts not yet trained on) it saves per rank (`rank_state`).
"""

from __future__ import annotations

import math
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    import torch
    from torch.utils.data import DataLoader


@dataclass(frozen=True)
class StepPlan:
    """How many micro-batches, optimizer steps and epochs a run takes."""

    micro_batches_per_epoch: int
    steps_per_epoch: int
    total_steps: int
    epochs: int


def plan_steps(
    micro_batches_per_epoch: int, accumulation: int, epochs: int, max_steps: int | None
) -> StepPlan:
    """Optimizer steps per epoch (a short last window still steps), total steps and epochs to run."""
    per_epoch = math.ceil(micro_batches_per_epoch / accumulation)
    total = max_steps if max_steps is not None else epochs * per_epoch
    return StepPlan(micro_batches_per_epoch, per_epoch, total, math.ceil(total / per_epoch))


@dataclass(frozen=True)
class Window:
    """One optimizer step's micro-batches on this rank, the source's position once they are trained (JSON,
    the same on every rank) and whether they end their epoch."""

    batches: list[dict[str, Any]]
    position: dict[str, Any]
    last: bool = False


@runtime_checkable
class StepSource(Protocol):
    """What the loop trains on. The loop holds the position; the source holds nothing a resume needs besides
    `rank_state()`."""

    def plan(self, epochs: int, max_steps: int | None) -> StepPlan:
        """The run's micro-batches and steps per epoch, total steps and epochs."""
        ...

    def windows(self, epoch: int, position: dict[str, Any]) -> Iterator[Window]:
        """This rank's windows of `epoch` from `position` ({}: the epoch's start, else a Window's position),
        as many on every rank; the epoch ends when the iterator does. Every rank asks for its next window at
        the same point, so making one may be collective (generation on a sharded engine)."""
        ...

    def rank_state(self) -> dict[str, torch.Tensor]:
        """What this rank must save with a checkpoint beyond the position (its sampling generator, buffered
        rollouts); {} for none."""
        ...

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        """Restore what rank_state returned ({} from a checkpoint that has none)."""
        ...


def accumulation_windows(loader, accumulation: int):
    """Group micro-batches into windows of `accumulation`; the epoch's last window may be shorter."""
    window: list[dict[str, Any]] = []
    for batch in loader:
        window.append(batch)
        if len(window) == accumulation:
            yield window
            window = []
    if window:
        yield window


# StaticSteps' position: micro-batches of the epoch already trained (the name LoopState had for it before
# step sources, so an older checkpoint's field is read as this position).
DONE = "micro_batches_done"


@dataclass(frozen=True)
class StaticSteps:
    """A fixed dataset's steps: `loader`'s batches (its batch_sampler a ResumableBatchSampler) in windows of
    `accumulation`. Every epoch's order is fixed by (seed, epoch), so resuming skips the micro-batches already
    trained, by number, loading none of them."""

    loader: DataLoader
    accumulation: int

    @property
    def micro_batches_per_epoch(self) -> int:
        """This rank's micro-batches in one epoch (the same on every rank)."""
        return len(self.loader.batch_sampler)

    def plan(self, epochs: int, max_steps: int | None) -> StepPlan:
        """plan_steps over this loader's epoch."""
        return plan_steps(self.micro_batches_per_epoch, self.accumulation, epochs, max_steps)

    def windows(self, epoch: int, position: dict[str, Any]) -> Iterator[Window]:
        """The windows of `epoch` after the micro-batches `position` says were trained."""
        sampler = self.loader.batch_sampler
        sampler.set_epoch(epoch)
        done = int(position.get(DONE, 0))
        if done:
            sampler.skip_next(done)
        total = self.micro_batches_per_epoch
        for window in accumulation_windows(self.loader, self.accumulation):
            done += len(window)
            yield Window(window, {DONE: done}, last=done >= total)

    def rank_state(self) -> dict[str, torch.Tensor]:
        """Nothing: the position says everything."""
        return {}

    def load_rank_state(self, state: dict[str, torch.Tensor]) -> None:
        """Nothing to restore."""
