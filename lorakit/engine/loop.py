"""The training loop on a DeepSpeed engine: token-weighted loss over accumulation windows and ranks."""

from __future__ import annotations

import math
import time
from dataclasses import dataclass
from typing import Any

from torch.utils.data import DataLoader

from lorakit.engine import dist
from lorakit.engine.loss import micro_batch_loss, token_loss_sum
from lorakit.meter import TokenMeter


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


def accumulation_windows(loader: DataLoader, accumulation: int):
    """Group micro-batches into windows of `accumulation`; the epoch's last window may be shorter."""
    window: list[dict[str, Any]] = []
    for batch in loader:
        window.append(batch)
        if len(window) == accumulation:
            yield window
            window = []
    if window:
        yield window


def train_window(engine, inputs, window: list[dict[str, Any]], meter: TokenMeter) -> dict[str, float]:
    """Forward/backward every micro-batch of one window and take one optimizer step.

    The loss backpropagated is the sum of token losses over the window on every rank, divided by the
    number of target tokens in the window on every rank: identical to one big batch holding them all.
    """
    device = engine.device
    world = dist.world_size()
    (window_tokens,) = dist.all_reduce([sum(b["num_target_tokens"] for b in window)])
    local_loss = 0.0
    real = slots = 0
    for i, batch in enumerate(window):
        # The window, not DeepSpeed's micro-step counter, decides when gradients are reduced and applied,
        # so a short last window of an epoch still steps with correctly weighted gradients.
        engine.set_gradient_accumulation_boundary(i == len(window) - 1)
        logits = inputs.logits(engine, batch, device)
        loss_sum = token_loss_sum(logits, batch["labels"].to(device))
        engine.backward(micro_batch_loss(loss_sum, window_tokens, world), scale_wrt_gas=False)
        engine.step()
        local_loss += float(loss_sum.detach())
        meter.add(batch)
        real += batch["num_real_tokens"]
        slots += batch["num_token_slots"]
    loss, real, slots = dist.all_reduce([local_loss, real, slots])
    norm = engine.get_global_grad_norm()
    return {
        "loss": loss / max(window_tokens, 1.0),
        "grad_norm": float(norm) if norm is not None else None,
        "target_tokens": int(window_tokens),
        "real_tokens": int(real),
        "token_slots": int(slots),
    }


class Trainer:
    """Runs the epochs: windows, logging, per-epoch evaluation hooks. Knows nothing of files."""

    def __init__(
        self,
        engine,
        inputs,
        loader: DataLoader,
        sampler,
        plan: StepPlan,
        accumulation: int,
        log,
        evaluate=None,
        progress=None,
        log_every: int = 1,
    ):
        self.engine, self.inputs, self.loader, self.sampler, self.plan = engine, inputs, loader, sampler, plan
        self.accumulation, self.log, self.evaluate, self.progress = accumulation, log, evaluate, progress
        self.log_every = log_every
        self.meter = TokenMeter()
        self.losses: list[float] = []
        self.train_seconds = 0.0
        self.step = 0
        self.global_real_tokens = 0
        self.global_token_slots = 0

    def run(self) -> None:
        """Train for the planned steps, evaluating after each epoch."""
        self.engine.train()
        for epoch in range(self.plan.epochs):
            self.sampler.set_epoch(epoch)
            # The clock runs from the end of one step's bookkeeping to the end of the next step, so batch
            # loading and collation count towards train_seconds; logging does not.
            start = time.perf_counter()
            for window in accumulation_windows(self.loader, self.accumulation):
                stats = train_window(self.engine, self.inputs, window, self.meter)
                seconds = time.perf_counter() - start
                self.train_seconds += seconds
                self.step += 1
                self.losses.append(stats["loss"])
                self.global_real_tokens += stats["real_tokens"]
                self.global_token_slots += stats["token_slots"]
                record = {
                    "kind": "train",
                    "step": self.step,
                    "epoch": epoch,
                    "loss": stats["loss"],
                    "lr": self.engine.get_lr()[0],
                    "grad_norm": stats["grad_norm"],
                    "tokens_per_second": stats["real_tokens"] / seconds if seconds > 0 else None,
                    "target_tokens": stats["target_tokens"],
                }
                # Every log_every-th step, and always the last, so the run's final loss is on record.
                if self.step % self.log_every == 0 or self.step >= self.plan.total_steps:
                    self.log(record)
                if self.progress is not None:
                    self.progress.update(1)
                    self.progress.set_postfix(loss=f"{stats['loss']:.4f}")
                if self.step >= self.plan.total_steps:
                    break
                start = time.perf_counter()
            if self.evaluate is not None:
                self.evaluate(epoch, self.step)
            if self.step >= self.plan.total_steps:
                break

    def tokens_per_second(self) -> float:
        """Useful (non-pad) tokens per second of training, over all ranks."""
        return self.global_real_tokens / self.train_seconds if self.train_seconds else 0.0
