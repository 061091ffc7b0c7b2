"""The training loop on any backend's Engine (lorakit.backends): token-weighted loss over accumulation windows
and ranks."""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from lorakit import dist
from lorakit.backends import Engine
from lorakit.engine.best import EARLY_STOPPING, BestPolicy, judge
from lorakit.engine.checkpoint import LoopState
from lorakit.engine.steps import StepPlan, StepSource
from lorakit.errors import LorakitError
from lorakit.meter import TokenMeter, peak_memory
from lorakit.model.loss import micro_batch_loss
from lorakit.objectives.base import Objective
from lorakit.objectives.sft import SFT


def train_window(
    engine: Engine,
    inputs,
    window: list[dict[str, Any]],
    meter: TokenMeter,
    objective: Objective = SFT,
    stop_here: Callable[[], bool] | None = None,
    failed_here: Callable[[], bool] | None = None,
) -> dict[str, Any]:
    """Forward/backward every micro-batch of one window and take one optimizer step.

    The loss backpropagated is the sum of the objective's losses (SFT: token losses) over the window on
    every rank, divided by its units (SFT: target tokens) in the window on every rank: identical to one big
    batch holding them all. The objective's metric sums are divided alike. `stop_here()` (whether this rank
    was asked to stop, read as the window ends) rides on the window's closing all_reduce: the result's
    `stop_requested` says whether any rank was, with no collective of its own per step; `failed_here()`
    (rank 0's metrics write failed) rides along the same way, as `rank_failed`.
    """
    device = engine.device
    world = dist.world_size()
    window_tokens, window_units = dist.all_reduce(
        [sum(b["num_target_tokens"] for b in window), sum(objective.units(b) for b in window)]
    )
    # Summed on the device: one host sync per window (with the counts below), not one per micro-batch, so
    # the next forward is queued while the GPU still runs this one.
    local_loss = None
    sums: dict[str, Any] = {}
    real = slots = 0
    for i, batch in enumerate(window):
        loss_sum, metrics = objective.loss(engine, inputs, batch, device)
        # The window, not a count of micro-batches, marks the boundary: a short last window of an epoch
        # still steps with correctly weighted gradients.
        engine.backward(micro_batch_loss(loss_sum, window_units, world), boundary=i == len(window) - 1)
        local_loss = loss_sum.detach() if local_loss is None else local_loss + loss_sum.detach()
        for name, value in metrics.items():
            sums[name] = sums.get(name, 0.0) + value
        meter.add(batch)
        real += batch["num_real_tokens"]
        slots += batch["num_token_slots"]
    step = engine.step()
    names = sorted(sums)
    loss, real, slots, stops, fails, *values = dist.all_reduce(
        [
            float(local_loss),
            real,
            slots,
            float(bool(stop_here and stop_here())),
            float(bool(failed_here and failed_here())),
            *(float(sums[k]) for k in names),
        ]
    )
    return {
        "loss": loss / max(window_units, 1.0),
        "grad_norm": step.grad_norm,
        # Whether the update was applied (a backend skips one whose gradients are not finite).
        "applied": step.applied,
        "lr": step.lr,
        "target_tokens": int(window_tokens),
        "real_tokens": int(real),
        "token_slots": int(slots),
        "metrics": objective.step_metrics(dict(zip(names, values, strict=True)), window_units),
        "stop_requested": stops > 0,
        "rank_failed": fails > 0,
    }


class Preempted(LorakitError):
    """The run was asked to stop (SIGTERM, SIGUSR1) and saved a resumable checkpoint: relaunch to resume."""

    # EX_TEMPFAIL (sysexits.h): a temporary failure, the caller is invited to retry.
    exit_code = 75
    doc = "docs/resume.md#preemption-sigterm-and-sigusr1"


class TrainingDiverged(LorakitError):
    """A step's loss or gradient norm was not finite (train.on_nonfinite: error, or too many skipped)."""

    exit_code = 4
    doc = "docs/resume.md#non-finite-loss-or-gradients-trainon_nonfinite"


@dataclass(frozen=True)
class Checkpointing:
    """When the loop saves resumable checkpoints; `save(reason)` writes one (collective) and returns its
    path."""

    save: Callable[[str], Any]
    every: int | None = None
    at_epoch_end: bool = True


@dataclass(frozen=True)
class NonFinitePolicy:
    """What a step with a NaN or infinite loss or gradient norm does: stop (error) or is skipped."""

    action: str = "error"
    max_skipped: int = 10


@dataclass(frozen=True)
class LoopPolicy:
    """What the loop does besides training windows: the plan, how often it logs, evaluates (`eval_every`
    steps, and after each epoch) and saves, what a non-finite step does, and the best-evaluation policy."""

    plan: StepPlan
    log_every: int = 1
    eval_every: int | None = None
    checkpointing: Checkpointing | None = None
    nonfinite: NonFinitePolicy = NonFinitePolicy()
    best: BestPolicy | None = None


def _finite(x: float | None) -> bool:
    return x is None or math.isfinite(x)


class Trainer:
    """Runs the epochs of a StepSource's windows: logging, evaluation (after each epoch and every
    `eval_every` steps), the best evaluation and early stopping, checkpoints, preemption and non-finite
    steps. Knows nothing of files: logging, evaluating, saving the best weights and checkpoints are
    callbacks. The source's position after each window is kept in the LoopState, so it is in every
    checkpoint.

    `evaluate(epoch, step, epoch_end=...)` returns the evaluation's metrics, the same on every rank; every
    rank calls it at the same steps (a sharded engine's forwards are collective)."""

    def __init__(
        self,
        engine: Engine,
        inputs,
        steps: StepSource,
        policy: LoopPolicy,
        log: Callable[[dict[str, Any]], None],
        *,
        evaluate=None,
        progress=None,
        state: LoopState | None = None,
        # Whether this rank was asked to stop (local); train_window shares it with every rank.
        stop_requested: Callable[[], bool] | None = None,
        meter: TokenMeter | None = None,
        objective: Objective = SFT,
    ):
        self.engine, self.inputs, self.steps, self.policy = engine, inputs, steps, policy
        self.plan, self.log, self.evaluate, self.progress = policy.plan, log, evaluate, progress
        self.state = state or LoopState()
        self.stop_requested = stop_requested or (lambda: False)
        # This rank's token counts; a resumed run passes the meter it continues.
        self.meter = meter if meter is not None else TokenMeter()
        self.last_checkpoint = None
        self.objective = objective
        # Rank 0's failed write of a metric record (a full disk), until every rank has learned of it.
        self.failure: Exception | None = None
        # Called once, on every rank, after this process's first step (the MoE expert-gradient check).
        self.after_first_step: Callable[[], Any] | None = None

    def run(self) -> None:
        """Train for the planned steps (from where the state says), evaluating after each epoch and every
        `eval_every` steps, until the steps are done or early stopping ends it."""
        self._run()
        self._raise_failure()  # a failed write of the last records, before anything is saved as finished

    def _run(self) -> None:
        self.engine.train()
        st, plan, policy = self.state, self.plan, self.policy
        if st.step >= plan.total_steps or st.stop_reason is not None:
            return
        for epoch in range(st.epoch, plan.epochs):
            # The clock runs from the end of one step's bookkeeping to the end of the next step, so making
            # the window (batch loading and collation, a rollout's generation) counts towards
            # train_seconds; logging does not.
            start = time.perf_counter()
            # A resumed epoch continues from the saved position: the source yields exactly the windows the
            # interrupted run had next.
            for window in self.steps.windows(epoch, st.position):
                stats = train_window(
                    self.engine,
                    self.inputs,
                    window.batches,
                    self.meter,
                    self.objective,
                    self.stop_requested,
                    lambda: self.failure is not None,
                )
                if stats["rank_failed"]:
                    self._raise_failure()
                seconds = time.perf_counter() - start
                st.position = window.position
                self._account(epoch, stats, seconds)
                if self.after_first_step is not None:
                    check, self.after_first_step = self.after_first_step, None
                    check()
                if self.evaluate is not None and policy.eval_every and st.step % policy.eval_every == 0:
                    # An eval.every step that ends the epoch or the run is that epoch's evaluation.
                    self._evaluate(epoch, epoch_end=st.step >= plan.total_steps or window.last)
                if st.step >= plan.total_steps or st.stop_reason is not None:
                    break
                if stats["stop_requested"]:
                    self._save("preempted")
                    raise Preempted(
                        f"stopped at step {st.step} on request (SIGTERM/SIGUSR1); checkpoint saved to "
                        f"{self.last_checkpoint}. Relaunch the same command to resume."
                    )
                ck = policy.checkpointing
                if ck is not None and ck.every and st.step % ck.every == 0:
                    self._save("every")
                start = time.perf_counter()
            if st.stop_reason is not None:
                self._save(st.stop_reason)
                break
            if self.evaluate is not None and st.last_eval_step != st.step:
                self._evaluate(epoch, epoch_end=True)
                if st.stop_reason is not None:
                    self._save(st.stop_reason)
                    break
            st.epoch, st.position = epoch + 1, {}
            if policy.checkpointing is not None and policy.checkpointing.at_epoch_end:
                self._save("epoch")
            if st.step >= plan.total_steps:
                break

    def _evaluate(self, epoch: int, *, epoch_end: bool) -> None:
        st = self.state
        # Evaluation switches the model to eval mode and back; the engine's train/eval flag is restored here
        # too, so a custom `evaluate` cannot leave dropout off for the steps that follow.
        with dist.phase("evaluation", st.step):  # what an evaluation's failure names
            st.eval = dict(self.evaluate(epoch, st.step, epoch_end=epoch_end) or {})
        self.engine.train()
        st.last_eval_step = st.step
        if self.policy.best is None:
            return
        verdict = judge(st, self.policy.best, st.eval, st.step, epoch)
        if verdict.improved and self.policy.best.save is not None:
            self.policy.best.save()
        if verdict.stop:
            st.stop_reason = EARLY_STOPPING

    def _account(self, epoch: int, stats: dict[str, Any], seconds: float) -> None:
        st = self.state
        st.step += 1
        st.train_seconds += seconds
        st.global_real_tokens += stats["real_tokens"]
        st.global_token_slots += stats["token_slots"]
        finite = _finite(stats["loss"]) and _finite(stats["grad_norm"]) and stats["applied"]
        record = {
            "kind": "train",
            "step": st.step,
            "epoch": epoch,
            "loss": stats["loss"],
            "lr": stats["lr"],
            "grad_norm": stats["grad_norm"],
            "tokens_per_second": stats["real_tokens"] / seconds if seconds > 0 else None,
            "target_tokens": stats["target_tokens"],
            # Cumulative useful tokens, so runs compare on a token axis whatever log_every is.
            "tokens": st.global_real_tokens,
            # The objective's own numbers (DPO: rewards, margin, accuracy); none for SFT.
            **stats.get("metrics", {}),
        }
        # This process's peaks so far (rank 0's, where records are written; summary.json has every rank's).
        memory = peak_memory()
        record["peak_cpu_rss_bytes"] = memory["cpu_rss"]
        if memory["gpu"] is not None:
            record["peak_gpu_bytes"] = memory["gpu"]
        if not finite:
            record["skipped"] = self.policy.nonfinite.action == "skip"
            # A non-finite step is always on record, whatever log_every says.
            self._log(record)
            self._nonfinite(stats)
            return
        st.losses.append(stats["loss"])
        # Every log_every-th step, and always the last, so the run's final loss is on record.
        if st.step % self.policy.log_every == 0 or st.step >= self.plan.total_steps:
            self._log(record)
        if self.progress is not None:
            self.progress.update(1)
            self.progress.set_postfix(loss=f"{stats['loss']:.4f}")

    def _log(self, record: dict[str, Any]) -> None:
        # Only rank 0 writes records, so only it can fail here (a full disk under metrics.jsonl). Raised at
        # once, the others would wait for it in the next collective until distributed.timeout_minutes; kept,
        # every rank learns of it at the next window's closing all_reduce, or as the loop ends.
        try:
            self.log(record)
        except Exception as e:
            self.failure = self.failure or e

    def _raise_failure(self) -> None:
        """Every rank stops: rank 0 with its failed write, the others with RankFailedError naming it."""

        def raise_it() -> None:
            if self.failure is not None:
                raise self.failure

        dist.on_main("metrics write", raise_it, at=self.state.step)

    def _nonfinite(self, stats: dict[str, Any]) -> None:
        st = self.state
        what = f"step {st.step}: loss {stats['loss']}, gradient norm {stats['grad_norm']}"
        last = f"the last checkpoint is {self.last_checkpoint}" if self.last_checkpoint else "no checkpoint"
        if self.policy.nonfinite.action == "skip":
            st.skipped_steps.append(st.step)
            if self.progress is not None:
                self.progress.update(1)
            if len(st.skipped_steps) <= self.policy.nonfinite.max_skipped:
                return
            raise TrainingDiverged(
                f"{what}: more than train.max_skipped_steps={self.policy.nonfinite.max_skipped} steps were not "
                f"finite (steps {st.skipped_steps}); stopped, {last}. Lower train.lr or check the data"
            )
        raise TrainingDiverged(
            f"{what} is not finite; stopped, {last} (was written before it). Lower train.lr or check the "
            "data, or set train.on_nonfinite: skip to drop such steps"
        )

    def _save(self, reason: str) -> None:
        if self.policy.checkpointing is not None:
            self.last_checkpoint = self.policy.checkpointing.save(reason)
