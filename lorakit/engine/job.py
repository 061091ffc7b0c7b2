"""One training job, run by every process of the group.

`run_job` reads as the job runs: resume lookup -> model config and tokenizer -> data -> model -> run
directory -> batching -> engine -> resume -> loop -> save -> summary. The steps after the engine share a
`Job`, whose methods are the loop's evaluation and checkpoint callbacks.
"""

from __future__ import annotations

import dataclasses
import os
import shutil
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lorakit import rundir
from lorakit.data import PreparedData, prepare_data
from lorakit.data.batching import Batching, make_batching
from lorakit.data.sampler import ResumableBatchSampler
from lorakit.data.sequence_split import split_sequences
from lorakit.engine import checkpoint, dist

# accelerator_name: re-exported, lorakit.api and the tests import it from here.
from lorakit.engine.backend import accelerator_name as accelerator_name
from lorakit.engine.backend import backend_for, device_kind
from lorakit.engine.best import BestPolicy
from lorakit.engine.checkpoint import Checkpoint, LoopState
from lorakit.engine.loop import (
    Checkpointing,
    NonFinitePolicy,
    Preempted,
    StepPlan,
    Trainer,
    TrainingDiverged,
    plan_steps,
)
from lorakit.engine.mesh import ParallelDims
from lorakit.engine.objective import make_objective
from lorakit.engine.result import EXIT, TrainResult
from lorakit.engine.save import save_trained
from lorakit.engine.signals import StopRequests
from lorakit.engine.summary import MemoryProbe, summarize
from lorakit.evaluation.classify import save_classification
from lorakit.evaluation.runner import run_eval
from lorakit.meter import TokenMeter
from lorakit.model import BuiltModel, build_model, count_parameters, load_config, load_tokenizer
from lorakit.model.quantize import describe_quantization, quantization_summary
from lorakit.model.shared_prompt import sharing_problem
from lorakit.observe import MetricsLogger
from lorakit.observe.plot import plot_losses
from lorakit.recipe import Recipe, dump_recipe


def run_job(recipe: Recipe) -> TrainResult:
    """Train `recipe` in this process group (already initialised) and write the run directory on rank 0."""
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    # Before any work: a checkpoint from another recipe or world size is refused here, not after loading.
    resume_from = checkpoint.find_resume(recipe, run_dir)
    backend = backend_for(recipe)
    backend.check_group()
    # Each step ends in a collective where every rank learns whether another failed (engine/dist.py).
    source, config, tokenizer = dist.on_every_rank("load", _load_config_and_tokenizer, recipe)
    data = prepare_everywhere(recipe, tokenizer, config)
    ds_config = backend.config(config)
    memory = MemoryProbe(device_kind())
    # Data-parallel replicas x sequence-parallel groups; the data is split over the replicas.
    mesh = ParallelDims.build(recipe.distributed.sequence_parallel)
    built = dist.on_every_rank(
        "load", build_model, recipe, backend.load_config(ds_config), sp_group=mesh.sp_group
    )
    params = count_parameters(built.model)
    log = (
        dist.on_main(
            "tracker start", open_run_dir, recipe, run_dir, ds_config, resume_from, backend.config_file
        )
        or MetricsLogger()
    )
    batching = make_batching(
        recipe,
        data,
        tokenizer,
        config,
        packing=built.packing,
        world=mesh.dp_world,
        rank=mesh.dp_rank,
        share_prompt_problem=sharing_problem(built.attention),
    )
    batching = split_sequences(batching, mesh.sp_rank, mesh.sp_world, tokenizer.pad_token_id)
    loader = make_loader(data, batching, seed=recipe.train.seed)
    t = recipe.train
    plan = plan_steps(len(loader.batch_sampler), t.gradient_accumulation_steps, t.epochs, t.max_steps)
    _say(batching.describe(plan, dist.world_size()))
    engine, quantization = start_engine(recipe, backend, built, ds_config, plan)
    if t.objective == "dpo" and not recipe.method.adapter():
        # Full fine-tuning DPO: the initial model's log-probabilities, before any step or checkpoint load.
        from lorakit.engine.dpo_reference import attach_reference

        objective = make_objective(recipe, config)
        data = attach_reference(
            recipe, engine, built.inputs, objective, built.source, data, batching.eval_collator
        )
        loader = make_loader(data, batching, seed=t.seed)
    job = Job(
        recipe, run_dir, config, tokenizer, data, built, params, batching, plan, engine, quantization, log
    )
    job.resume(resume_from)
    trainer = job.trainer(loader)
    job.train(trainer)
    model_states = memory.model_states()
    with dist.phase("adapter save", job.state.step):
        saved = save_trained(engine, built, recipe, run_dir) if recipe.output.save_adapter else {}
    summary = summarize(job, trainer, memory.peak(model_states), saved, memory.device_kind).to_json()
    job.finish(summary)
    return TrainResult(run_dir, summary)


def _load_config_and_tokenizer(recipe: Recipe) -> tuple[Any, Any, Any]:
    source, config = load_config(recipe)
    return source, config, load_tokenizer(recipe, source)


def _say(line: str) -> None:
    """Print a line for the user, once (rank 0)."""
    if dist.is_main():
        print(line, flush=True)


def prepare_everywhere(recipe: Recipe, tokenizer, config) -> PreparedData:
    """The recipe's PreparedData on every rank, tokenized once."""
    # Rank 0 tokenizes (or finds the cache); the others wait and then read its cache entry. Where nodes do
    # not share data.cache_dir, the first process of each other node then tokenizes once for its node.
    # A failure on any rank reaches the others at the end of each step instead of leaving them at a barrier.
    data = dist.on_main("prepare", prepare_data, recipe, tokenizer, config)
    first_on_node = data is None and os.environ.get("LOCAL_RANK", "0") == "0"

    def prepare_if(needed: bool, data: PreparedData | None) -> PreparedData | None:
        return prepare_data(recipe, tokenizer, config) if needed else data

    data = dist.on_every_rank("prepare", prepare_if, first_on_node, data)
    data = dist.on_every_rank("prepare", prepare_if, data is None, data)
    if not (dist.world_size() > 1 and data.cache_hit):
        # Under a multi-process launch from lorakit.train, the launcher already reported the data step.
        _say(data.describe())
    return data


def open_run_dir(
    recipe: Recipe,
    run_dir: Path,
    ds_config: dict,
    resume_from: Checkpoint | None,
    config_file: str = rundir.DS_CONFIG,
) -> MetricsLogger:
    """Rank 0 clears what an earlier run left for this one to write, writes the resolved recipe and the
    backend's config (as `config_file`), and opens the metrics and the trackers of output.report_to
    (continuing them on resume); returns the MetricsLogger (one without sinks on the other ranks)."""
    if not dist.is_main():
        return MetricsLogger()
    run_dir.mkdir(parents=True, exist_ok=True)
    for stale in (rundir.ADAPTER, rundir.MODEL, rundir.MERGED):
        shutil.rmtree(run_dir / stale, ignore_errors=True)
    for stale in (EXIT, rundir.CLASSIFICATION, rundir.CONFUSION_MATRIX, rundir.LOSS_PLOT):
        (run_dir / stale).unlink(missing_ok=True)
    if resume_from is None:
        # The best weights belong to the run that judged them; a resumed run keeps them with its state.
        shutil.rmtree(run_dir / rundir.BEST, ignore_errors=True)
    resolved = dump_recipe(recipe)
    rundir.write_text(run_dir / rundir.RECIPE, resolved)
    rundir.write_json(run_dir / config_file, ds_config)
    return MetricsLogger.for_run(
        run_dir,
        keep=resume_from.state["loop"]["metrics_records"] if resume_from else None,
        report_to=recipe.output.report_to,
        recipe=recipe.model_dump(mode="json"),
        recipe_yaml=resolved,
        resumed_step=resume_from.step if resume_from else None,
        tracker_timeout=recipe.output.tracker_timeout_seconds,
    )


def make_loader(data: PreparedData, batching: Batching, seed: int) -> DataLoader:
    """The training DataLoader; its batch_sampler is a ResumableBatchSampler around the batching's."""
    # Its own generator: a DataLoader draws a seed from the global torch RNG for every epoch's iterator,
    # which would shift dropout's random stream by one draw in a run resumed mid-epoch.
    return DataLoader(
        data.train,
        batch_sampler=ResumableBatchSampler(batching.sampler),
        collate_fn=batching.collator,
        generator=torch.Generator().manual_seed(seed),
    )


def start_engine(
    recipe: Recipe, backend, built: BuiltModel, ds_config: dict, plan: StepPlan
) -> tuple[Any, dict | None]:
    """The backend's engine over the trainable parameters with the recipe's LR schedule; returns the engine
    and, for QLoRA, the quantization summary (printed)."""
    engine = backend.start(built, ds_config, plan)
    # After the engine starts, so under ZeRO-3 it counts the partitioned base through ds_numel.
    quantization = quantization_summary(engine.module, recipe) if recipe.method.quantization() else None
    if quantization:
        _say(describe_quantization(quantization))
    return engine, quantization


def release(engine, built) -> None:
    """Undo the process-wide state a job leaves: ZeRO hooks, and transformers' "ZeRO-3 is on" flag, which
    would otherwise make every later from_pretrained in this process load partitioned."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    engine.destroy()
    built.hf_ds_config = None
    unset_hf_deepspeed_config()


@dataclass
class Job:
    """What the steps after deepspeed.initialize share (every rank): the engine, the data and the metrics,
    the loop's state and this rank's token counts."""

    recipe: Recipe
    run_dir: Path
    config: Any
    tokenizer: Any
    data: PreparedData
    built: BuiltModel
    # (trainable, total) parameters as built.
    params: tuple[int, int]
    batching: Batching
    plan: StepPlan
    engine: Any
    # QLoRA's quantization summary (start_engine); None for other methods.
    quantization: dict[str, Any] | None
    log: MetricsLogger
    resumed_from: Checkpoint | None = None
    state: LoopState = field(default_factory=LoopState)
    meter: TokenMeter = field(default_factory=TokenMeter)
    stops: StopRequests = field(default_factory=StopRequests)

    def resume(self, ckpt: Checkpoint | None) -> None:
        """Restore engine, RNG states, loop state and this rank's counts from `ckpt` (collective)."""
        if ckpt is None:
            return
        self.resumed_from = ckpt
        self.state, counters = checkpoint.load_checkpoint(
            self.engine, ckpt, adapter=self.recipe.method.adapter()
        )
        self.meter = TokenMeter.from_counters(counters)
        st = self.state
        _say(
            f"resuming from {ckpt.path} (step {st.step} of {self.plan.total_steps}, epoch {st.epoch + 1}, "
            f"{st.micro_batches_done} micro-batches into it)"
        )

    def eval_data(self) -> PreparedData:
        """The data in-run evaluations use: eval.max_samples caps the eval rows (the first ones)."""
        cap = self.recipe.eval.max_samples
        if cap is None or self.data.eval is None or len(self.data.eval) <= cap:
            return self.data
        return dataclasses.replace(self.data, eval=self.data.eval.select(range(cap)))

    def evaluate(self, epoch: int, step: int, epoch_end: bool = True) -> dict[str, Any]:
        """Eval loss (and generation metrics) on every rank (evaluation.runner.run_eval, as lorakit.evaluate
        scores a finished run); rank 0 logs them and writes the predictions and classification report.
        Returns rank 0's metrics on every rank. `epoch_end` False (an eval.every evaluation) generates only
        with eval.generate_at every_eval."""
        ev = self.recipe.eval
        # The RNG streams are put back afterwards, so a run with evaluations trains exactly as one without.
        with checkpoint.preserved_rng():
            outcome = run_eval(
                self.engine,
                self.built.inputs,
                self.recipe,
                self.eval_data(),
                self.tokenizer,
                self.batching.eval_collator,
                zero3=self.recipe.distributed.zero_stage == 3,
                generate=ev.generate and (epoch_end or ev.generate_at == "every_eval"),
            )
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
        )

    def trainer(self, loader: DataLoader) -> Trainer:
        """The loop over `loader`, with this job's callbacks, policies and (on rank 0) a progress bar."""
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
        return Trainer(
            self.engine,
            self.built.inputs,
            loader,
            loader.batch_sampler,
            self.plan,
            t.gradient_accumulation_steps,
            self.log,
            self.evaluate if evaluates else None,
            progress,
            log_every=t.log_every,
            state=self.state,
            checkpointing=Checkpointing(self.save_checkpoint, ck.every, ck.at_epoch_end),
            nonfinite=NonFinitePolicy(t.on_nonfinite, t.max_skipped_steps),
            stop_requested=self.stops.received_here,
            meter=self.meter,
            eval_every=self.recipe.eval.every,
            best=self.best_policy() if evaluates else None,
            objective=make_objective(self.recipe, self.config),
        )

    def train(self, trainer: Trainer) -> None:
        """Run the loop; a run stopped early (preempted, diverged) leaves exit.json, releases the engine and
        re-raises."""
        try:
            with self.stops, dist.phase("training", lambda: self.state.step + 1):
                trainer.run()
        except (Preempted, TrainingDiverged) as e:
            if dist.is_main():
                # The launching process (lorakit.train over torchrun) reads this to exit with the same code.
                info = {"code": e.exit_code, "error": type(e).__name__, "message": str(e)}
                rundir.write_json(self.run_dir / EXIT, info)
            self.log.close()
            release(self.engine, self.built)
            raise
        finally:
            if trainer.progress is not None:
                trainer.progress.close()

    def finish(self, summary: dict[str, Any]) -> None:
        """Rank 0 writes summary.json and closes the metrics; then every rank releases the engine."""
        dist.on_main("summary", self._write_summary, summary)
        release(self.engine, self.built)

    def _write_summary(self, summary: dict[str, Any]) -> None:
        rundir.write_json(self.run_dir / rundir.SUMMARY, summary)
        self.log.close()
        plot_losses(self.run_dir)
