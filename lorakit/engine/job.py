"""One training job, run by every process of the group.

`run_job` reads as the job runs: resume lookup -> model config and tokenizer -> data -> model -> run
directory -> batching and the step source -> engine -> resume -> loop -> save -> summary. The steps after the engine share a
`Job` (engine/session.py), whose methods are the loop's evaluation and checkpoint callbacks. The backend
(distributed.strategy) is a lorakit.backends.Backend; the job and the loop see only its Engine.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lorakit import dist, rundir
from lorakit.backends import Backend, Engine, backend_for, device_kind
from lorakit.data import PreparedData
from lorakit.data.batching import Batching
from lorakit.data.sampler import ResumableBatchSampler
from lorakit.data.sequence_split import split_sequences
from lorakit.engine import branches, checkpoint
from lorakit.engine.checkpoint import Checkpoint
from lorakit.engine.mesh import ParallelDims
from lorakit.engine.result import EXIT, TrainResult
from lorakit.engine.save import save_trained
from lorakit.engine.schedule import lambda_lr_factory
from lorakit.engine.session import Job, say
from lorakit.engine.steps import StaticSteps, StepPlan
from lorakit.engine.summary import MemoryProbe, summarize
from lorakit.model import BuiltModel, build_model, count_parameters, load_config, load_tokenizer
from lorakit.model.expert_gradients import ExpertGradientProbe
from lorakit.model.families import family_of
from lorakit.model.families.moe import describe as describe_moe
from lorakit.model.families.multimodal import describe as describe_towers
from lorakit.model.families.start import decoder_start
from lorakit.model.quantize import describe_quantization, quantization_summary
from lorakit.model.shared_prompt import sharing_problem
from lorakit.objectives import make_batching, make_objective, prepare_data
from lorakit.observe import MetricsLogger
from lorakit.recipe import Recipe, dump_recipe
from lorakit.runlock import LockWatch

# What the job asks of the planner (lorakit.planner.run_plan.plan_of_run, handed in by lorakit.api, a floor
# above): (recipe, model config, PreparedData, world size, device kind) -> the plan summary.json records.
PlanOfRun = Callable[[Recipe, Any, PreparedData, int, str], dict[str, Any]]


def run_job(recipe: Recipe, plan_of_run: PlanOfRun) -> TrainResult:
    """Train `recipe` in this process group (already initialised) and write the run directory on rank 0;
    `plan_of_run` gives the memory planner's plan of the run for summary.json."""
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    # Before any work: a checkpoint from another recipe or world size is refused here, not after loading.
    resume_from = checkpoint.find_resume(recipe, run_dir)
    backend = backend_for(recipe)
    backend.check_group()
    # Each step ends in a collective where every rank learns whether another failed (dist.py).
    source, config, tokenizer = dist.on_every_rank("load", _load_config_and_tokenizer, recipe)
    data = prepare_everywhere(recipe, tokenizer, config)
    backend_config = backend.describe(config)
    memory = MemoryProbe(device_kind())
    # Data-parallel replicas x sequence-parallel groups; the data is split over the replicas.
    mesh = ParallelDims.build(recipe.distributed.sequence_parallel)
    built = dist.on_every_rank(
        "load", build_model, recipe, backend.load_plan(backend_config), sp_group=mesh.sp_group
    )
    params = count_parameters(built.model)
    log = (
        dist.on_main(
            "tracker start", open_run_dir, recipe, run_dir, backend_config, resume_from, backend.config_file
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
    t = recipe.train
    steps = StaticSteps(make_loader(data, batching, seed=t.seed), t.gradient_accumulation_steps)
    plan = steps.plan(t.epochs, t.max_steps)
    say(batching.describe(plan, dist.world_size()))
    if moe_line := describe_moe(family_of(config), recipe.method, config):
        say(moe_line)
    if built.experts:
        say(built.experts)
    if built.is_encoder_decoder:
        say(decoder_start(config).describe(tokenizer))
    if recipe.method.adapter() and (towers_line := describe_towers(config, recipe.method.target_modules)):
        say(towers_line)
    engine, quantization = start_engine(recipe, backend, built, backend_config, plan)
    # What the objective needs before any step or checkpoint load (full fine-tuning DPO: the initial
    # model's log-probabilities of every pair, as columns of the data).
    objective = make_objective(recipe, config)
    prepared = objective.prepare_training(
        recipe, engine, built.inputs, built.source, data, batching.eval_collator
    )
    if prepared is not data:
        data = prepared
        steps = StaticSteps(make_loader(prepared, batching, seed=t.seed), t.gradient_accumulation_steps)
    job = Job(
        recipe,
        run_dir,
        config,
        tokenizer,
        data,
        built,
        params,
        batching,
        steps,
        plan,
        engine,
        quantization,
        log,
        objective,
    )
    job.resume(resume_from)
    if dist.is_main():
        job.lock = LockWatch(run_dir)
    trainer = job.trainer()
    # LoRA on fused experts: how many expert adapters the first step reached; none is an error.
    if probe := ExpertGradientProbe(built.model):
        trainer.after_first_step = lambda: probe.check(say)
    job.train(trainer)
    model_states = memory.model_states()
    with dist.phase("adapter save", job.state.step):
        saved = save_trained(engine, built, recipe, run_dir) if recipe.output.save_adapter else {}
    dist.on_main("adapter save", retire_earlier_outputs, recipe, run_dir, job.state.best)
    planned = plan_of_run(recipe, config, job.data, dist.world_size(), memory.device_kind)
    summary = summarize(job, trainer, memory.peak(model_states), saved, planned).to_json()
    job.finish(summary)
    return TrainResult(run_dir, summary)


def _load_config_and_tokenizer(recipe: Recipe) -> tuple[Any, Any, Any]:
    source, config = load_config(recipe)
    return source, config, load_tokenizer(recipe, source)


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
        say(data.describe())
    return data


def open_run_dir(
    recipe: Recipe,
    run_dir: Path,
    backend_config: dict,
    resume_from: Checkpoint | None,
    config_file: str,
) -> MetricsLogger:
    """Rank 0 writes the resolved recipe and the backend's config (as `config_file`), and opens the
    metrics and the trackers of output.report_to (continuing them on resume); returns the MetricsLogger
    (one without sinks on the other ranks). An earlier run's adapter/, model/, merged/ and best/ stay as
    they are: each is replaced whole when its successor is complete (storage.replace_directory), and what
    this run does not replace is retired once it has finished (retire_earlier_outputs)."""
    if not dist.is_main():
        return MetricsLogger()
    run_dir.mkdir(parents=True, exist_ok=True)
    rundir.mark(run_dir)
    # Reports of the last evaluation, redrawn by this run's; exit.json must not be read as this run's.
    for stale in (EXIT, rundir.CLASSIFICATION, rundir.CONFUSION_MATRIX, rundir.LOSS_PLOT):
        (run_dir / stale).unlink(missing_ok=True)
    resolved = dump_recipe(recipe)
    rundir.write_recipe(run_dir, resolved)
    rundir.write_json(run_dir / config_file, backend_config)
    return MetricsLogger.for_run(
        run_dir,
        keep=resume_from.state["loop"]["metrics_records"] if resume_from else None,
        report_to=recipe.output.report_to,
        recipe=recipe.model_dump(mode="json"),
        recipe_yaml=resolved,
        resumed_step=resume_from.step if resume_from else None,
        tracker_timeout=recipe.output.tracker_timeout_seconds,
    )


def retire_earlier_outputs(recipe: Recipe, run_dir: Path, best: dict[str, Any] | None) -> list[str]:
    """Rank 0, once this run's weights are saved: move aside (branches.set_aside, as abandoned checkpoints
    are; never deleted) what an earlier run in this directory left that this run does not replace: the
    other kind of weights (adapter/ or model/), merged/ unless output.merge replaces it next, and best/
    unless it holds this run's best evaluation (`best`, the loop's). Until now a failed run would have left
    them whole. Returns the names moved."""
    keep = set()
    if recipe.output.save_adapter:
        keep.add(rundir.ADAPTER if recipe.method.adapter() else rundir.MODEL)
    if recipe.output.merge:
        keep.add(rundir.MERGED)
    best_dir = run_dir / rundir.BEST
    if best_dir.is_dir() and best is not None and branches.best_step(run_dir) == best.get("step"):
        keep.add(rundir.BEST)
    names = [n for n in rundir.REPLACED if n not in keep and (run_dir / n).exists()]
    branches.set_aside(
        run_dir, [run_dir / n for n in names], "outputs of an earlier run this run does not replace"
    )
    return names


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
    recipe: Recipe, backend: Backend, built: BuiltModel, backend_config: dict, plan: StepPlan
) -> tuple[Engine, dict | None]:
    """The backend's engine over the trainable parameters with the recipe's LR schedule; returns the engine
    and, for QLoRA, the quantization summary (printed)."""
    t = recipe.train
    engine = backend.wrap(
        built, backend_config, lambda_lr_factory(plan.total_steps, t.warmup_ratio, t.lr_schedule)
    )
    # After the engine starts, so a sharded base is counted by its whole sizes.
    quantization = quantization_summary(engine.module, recipe) if recipe.method.quantization() else None
    if quantization:
        say(describe_quantization(quantization))
    return engine, quantization
