"""The job after its engine started: the state every rank shares while it trains, evaluates, saves the best
weights and checkpoints (the loop's callbacks), and finishes (lorakit.engine.job.run_job builds it)."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from lorakit import dist, rundir
from lorakit.backends import Engine
from lorakit.data import PreparedData
from lorakit.data.batching import Batching
from lorakit.engine import checkpoint
from lorakit.engine.best import BestPolicy
from lorakit.engine.checkpoint import Checkpoint, LoopState
from lorakit.engine.loop import (
    Checkpointing,
    LoopPolicy,
    NonFinitePolicy,
    Preempted,
    Trainer,
    TrainingDiverged,
)
from lorakit.engine.result import EXIT
from lorakit.engine.rng import preserved_rng
from lorakit.engine.save import save_trained
from lorakit.engine.signals import StopRequests
from lorakit.engine.steps import StepPlan, StepSource
from lorakit.evaluation.classify import save_classification
from lorakit.meter import TokenMeter
from lorakit.model import BuiltModel
from lorakit.objectives import Objective
from lorakit.observe import MetricsLogger
from lorakit.observe.plot import plot_losses
from lorakit.recipe import Recipe
from lorakit.runlock import LockWatch


def say(line: str) -> None:
    """Print a line for the user, once (rank 0)."""
    if dist.is_main():
        print(line, flush=True)


@dataclass
class Job:
    """What the steps after the engine starts share (every rank): the engine, the data, the step source and
    the metrics, the loop's state and this rank's token counts."""

    recipe: Recipe
    run_dir: Path
    config: Any
    tokenizer: Any
    data: PreparedData
    built: BuiltModel
    # (trainable, total) parameters as built.
    params: tuple[int, int]
    batching: Batching
    # What the loop trains on (engine/steps.py), and the run's plan of steps from it.
    steps: StepSource
    plan: StepPlan
    engine: Engine
    # QLoRA's quantization summary (start_engine); None for other methods.
    quantization: dict[str, Any] | None
    log: MetricsLogger
    # The recipe's objective (run_job made it for its reference pass): the loop's loss and the evaluations.
    objective: Objective
    resumed_from: Checkpoint | None = None
    state: LoopState = field(default_factory=LoopState)
    meter: TokenMeter = field(default_factory=TokenMeter)
    stops: StopRequests = field(default_factory=StopRequests)
    # Rank 0's watch on the run lock (lorakit.runlock.LockWatch): a lost lock stops the run like a SIGTERM.
    lock: LockWatch | None = None
    # Rank 0's progress bar (trainer() makes it): an evaluation says so on it, since the bar stands still.
    progress: Any = None

    def resume(self, ckpt: Checkpoint | None) -> None:
        """Restore engine, RNG states, loop state, the step source's state and this rank's counts from `ckpt`
        (collective)."""
        if ckpt is None:
            return
        self.resumed_from = ckpt
        self.state, counters, steps = checkpoint.load_checkpoint(
            self.engine, ckpt, adapter=self.recipe.method.adapter()
        )
        self.steps.load_rank_state(steps)
        self.meter = TokenMeter.from_counters(counters)
        st = self.state
        where = ", ".join(f"{k.replace('_', ' ')} {v}" for k, v in st.position.items()) or "at its start"
        say(
            f"resuming from {ckpt.path} (step {st.step} of {self.plan.total_steps}, epoch {st.epoch + 1}: {where})"
        )

    def eval_data(self) -> PreparedData:
        """The data in-run evaluations use: eval.max_samples caps the eval rows (the first ones)."""
        cap = self.recipe.eval.max_samples
        if cap is None or self.data.eval is None or len(self.data.eval) <= cap:
            return self.data
        return dataclasses.replace(self.data, eval=self.data.eval.select(range(cap)))

    def evaluate(self, epoch: int, step: int, epoch_end: bool = True) -> dict[str, Any]:
        """Eval loss (and generation metrics) on every rank (the objective's evaluation, as lorakit.evaluate
        scores a finished run); rank 0 logs them and writes the predictions and classification report.
        Returns rank 0's metrics on every rank. `epoch_end` False (an eval.every evaluation) generates only
        with eval.generate_at every_eval."""
        ev = self.recipe.eval
        generate = ev.generate and (epoch_end or ev.generate_at == "every_eval")
        if self.progress is not None:
            rows = len(self.eval_data().eval)
            self.progress.write(
                f"evaluating at step {step}: {rows} rows" + (", generating" if generate else "")
            )
            self.progress.set_description("evaluating")
        # The RNG streams are put back afterwards, so a run with evaluations trains exactly as one without.
        with preserved_rng():
            outcome = self.objective.evaluate(
                self.engine,
                self.built.inputs,
                self.recipe,
                self.eval_data(),
                self.tokenizer,
                self.batching.eval_collator,
                # A sharded engine's forwards are collective: ranks done generating keep stepping with the rest.
                zero3=self.engine.sharded,
                generate=generate,
            )
        if self.progress is not None:
            self.progress.set_description("training")
        # Only rank 0 scores generations: every rank must judge the best evaluation on the same numbers.
        return dist.on_main("eval write", self._write_eval, outcome, epoch, step, share=True, at=step)

    def _write_eval(self, outcome, epoch: int, step: int) -> dict[str, Any]:
        """Rank 0: the predictions, the classification report and the eval record; returns the metrics."""
        if outcome.predictions is not None:  # eval.generate
            rundir.write_predictions(self.run_dir, outcome.predictions, outcome.references)
            if outcome.classification is not None:
                save_classification(
                    outcome.classification,
                    self.run_dir / rundir.CLASSIFICATION,
                    self.run_dir / rundir.CONFUSION_MATRIX,
                )
        self.log({"kind": "eval", "step": step, "epoch": epoch, **outcome.metrics})
        return outcome.metrics

    def save_best(self) -> None:
        """The current weights as run_dir/best, with best.json naming the evaluation (collective)."""
        info = {**(self.state.best or {}), "eval": dict(self.state.eval)}
        save_trained(self.engine, self.built, self.recipe, self.run_dir, into=rundir.BEST, info=info)

    def best_policy(self) -> BestPolicy | None:
        """checkpoint.best_metric and train.early_stopping_patience as the loop's BestPolicy; None without."""
        ck = self.recipe.checkpoint
        if ck.best_metric is None:
            return None
        return BestPolicy(
            ck.best_metric, ck.best_direction(), self.recipe.train.early_stopping_patience, self.save_best
        )

    def save_checkpoint(self, reason: str) -> Path:
        """A resumable checkpoint of the current step (collective); returns its path."""
        self.state.metrics_records = self.log.records
        return checkpoint.save_checkpoint(
            self.engine,
            self.recipe,
            self.run_dir,
            self.state,
            self.meter.counters(),
            adapter=self.recipe.method.adapter(),
            reason=reason,
            rank_steps=self.steps.rank_state(),
        )

    def trainer(self) -> Trainer:
        """The loop over this job's step source, with its callbacks, policies and (on rank 0) a progress bar."""
        t, ck = self.recipe.train, self.recipe.checkpoint
        evaluates = self.recipe.eval_active() and self.data.eval is not None
        progress = None
        if dist.is_main():
            from tqdm.auto import tqdm

            progress = tqdm(
                total=self.plan.total_steps,
                initial=self.state.step,
                desc="training",
                unit="step",
                dynamic_ncols=True,
            )
        self.progress = progress
        policy = LoopPolicy(
            self.plan,
            log_every=t.log_every,
            eval_every=self.recipe.eval.every,
            checkpointing=Checkpointing(self.save_checkpoint, ck.every, ck.at_epoch_end),
            nonfinite=NonFinitePolicy(t.on_nonfinite, t.max_skipped_steps),
            best=self.best_policy() if evaluates else None,
        )
        return Trainer(
            self.engine,
            self.built.inputs,
            self.steps,
            policy,
            self.log,
            evaluate=self.evaluate if evaluates else None,
            progress=progress,
            state=self.state,
            stop_requested=self._stop_requested,
            meter=self.meter,
            objective=self.objective,
        )

    def _stop_requested(self) -> bool:
        return self.stops.received_here() or (self.lock is not None and self.lock.lost())

    def train(self, trainer: Trainer) -> None:
        """Run the loop; a run stopped early (preempted, diverged) leaves exit.json, releases the engine and
        re-raises."""
        try:
            with self.stops, dist.phase("training", lambda: self.state.step + 1):
                trainer.run()
        except (Preempted, TrainingDiverged) as stopped:
            e = stopped
            if isinstance(e, Preempted) and self.lock is not None and self.lock.lost_to is not None:
                e = Preempted(
                    f"stopped at step {self.state.step}: the run lock {self.lock.path} was taken over by "
                    f"{self.lock.lost_to}, so another run may be writing {self.run_dir}; checkpoint saved to "
                    f"{trainer.last_checkpoint}. Relaunch once the other run is done to resume."
                )
            if dist.is_main():
                # The launching process (lorakit.train over torchrun) reads this to exit with the same code.
                info = {"code": e.exit_code, "error": type(e).__name__, "message": str(e)}
                rundir.write_json(self.run_dir / EXIT, info)
            self.log.close()
            self.engine.close()
            if e is stopped:
                raise
            raise e from None
        finally:
            if trainer.progress is not None:
                trainer.progress.close()

    def finish(self, summary: dict[str, Any]) -> None:
        """Rank 0 writes summary.json and closes the metrics; then every rank releases the engine."""
        dist.on_main("summary", self._write_summary, summary)
        self.engine.close()

    def _write_summary(self, summary: dict[str, Any]) -> None:
        rundir.write_json(self.run_dir / rundir.SUMMARY, summary)
        self.log.close()
        plot_losses(self.run_dir)
