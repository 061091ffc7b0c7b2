"""One training job, run by every process of the group: build, train, evaluate, save, summarise."""

from __future__ import annotations

import os
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader

from lorakit import rundir
from lorakit.data import prepare_data
from lorakit.data.batching import make_batching
from lorakit.data.sampler import ResumableBatchSampler
from lorakit.engine import checkpoint, dist
from lorakit.engine.checkpoint import LoopState
from lorakit.engine.deepspeed_config import build_ds_config
from lorakit.engine.loop import (
    Checkpointing,
    NonFinitePolicy,
    Preempted,
    Trainer,
    TrainingDiverged,
    plan_steps,
)
from lorakit.engine.save import save_trained
from lorakit.engine.schedule import lambda_lr_factory
from lorakit.engine.signals import StopRequests
from lorakit.evaluation.generate import evaluate_model
from lorakit.meter import live_tensor_bytes, peak_memory
from lorakit.model import build_model, count_parameters, load_config, load_tokenizer
from lorakit.model.quantize import describe_quantization, quantization_summary
from lorakit.observe import MetricsLogger
from lorakit.recipe import Recipe, dump_recipe

# Written by rank 0 when training stops early with its own exit code (preempted, diverged).
EXIT = "exit.json"


@dataclass(frozen=True)
class TrainResult:
    """What lorakit.train returns: the run directory and its summary."""

    run_dir: Path
    summary: dict[str, Any]


def accelerator_name() -> str:
    """DeepSpeed's accelerator for this machine: `cuda`, or `cpu` where there is no GPU."""
    from deepspeed.accelerator import get_accelerator

    return get_accelerator().device_name()


def _prepare_everywhere(recipe: Recipe, tokenizer, config):
    # Rank 0 tokenizes (or finds the cache); the others wait and then read its cache entry. Where nodes do
    # not share data.cache_dir, the first process of each other node then tokenizes once for its node.
    data = prepare_data(recipe, tokenizer, config) if dist.is_main() else None
    dist.barrier()
    if data is None and os.environ.get("LOCAL_RANK", "0") == "0":
        data = prepare_data(recipe, tokenizer, config)
    dist.barrier()
    return data if data is not None else prepare_data(recipe, tokenizer, config)


def run_job(recipe: Recipe) -> TrainResult:
    """Train `recipe` in this process group (already initialised) and write the run directory on rank 0."""
    import deepspeed

    world, main = dist.world_size(), dist.is_main()
    run_dir = Path(recipe.output.dir).expanduser().resolve()
    # Before any work: a checkpoint from another recipe or world size is refused here, not after loading.
    resume_from = checkpoint.find_resume(recipe, run_dir)
    source, config = load_config(recipe)
    tokenizer = load_tokenizer(recipe, source)
    data = _prepare_everywhere(recipe, tokenizer, config)
    if main and not (dist.world_size() > 1 and data.cache_hit):
        # Under a multi-process launch from lorakit.train, the launcher already reported the data step.
        print(data.describe(), flush=True)
    hidden = getattr(config, "d_model", None) or getattr(config, "hidden_size", None)
    ds_config = build_ds_config(recipe, world, accelerator=accelerator_name(), hidden_size=hidden)
    zero3 = recipe.distributed.zero_stage == 3
    device_kind = "cpu" if accelerator_name() == "cpu" else "cuda"
    # Tensors alive before the model exists, so model states are measured as what the run added.
    tensors_before = live_tensor_bytes(device_kind)
    built = build_model(recipe, ds_config)
    trainable, total = count_parameters(built.model)

    log = MetricsLogger()
    if main:
        run_dir.mkdir(parents=True, exist_ok=True)
        for stale in (rundir.ADAPTER, rundir.MODEL, rundir.MERGED):
            shutil.rmtree(run_dir / stale, ignore_errors=True)
        (run_dir / EXIT).unlink(missing_ok=True)
        rundir.write_text(run_dir / rundir.RECIPE, dump_recipe(recipe))
        rundir.write_json(run_dir / rundir.DS_CONFIG, ds_config)
        log = MetricsLogger.for_run(
            run_dir, keep=resume_from.state["loop"]["metrics_records"] if resume_from else None
        )

    t = recipe.train
    batching = make_batching(
        recipe, data, tokenizer, config, packing=built.packing, world=world, rank=dist.rank()
    )
    sampler = ResumableBatchSampler(batching.sampler)
    # Its own generator: a DataLoader draws a seed from the global torch RNG for every epoch's iterator,
    # which would shift dropout's random stream by one draw in a run resumed mid-epoch.
    loader = DataLoader(
        data.train,
        batch_sampler=sampler,
        collate_fn=batching.collator,
        generator=torch.Generator().manual_seed(t.seed),
    )
    plan = plan_steps(len(sampler), t.gradient_accumulation_steps, t.epochs, t.max_steps)
    if main:
        print(batching.describe(plan, world), flush=True)
    engine, *_ = deepspeed.initialize(
        model=built.model,
        model_parameters=[p for p in built.model.parameters() if p.requires_grad],
        config=ds_config,
        lr_scheduler=lambda_lr_factory(plan.total_steps, t.warmup_ratio, t.lr_schedule),
    )
    # After deepspeed.initialize, so under ZeRO-3 it counts the partitioned base through ds_numel.
    quantization = quantization_summary(engine.module, recipe) if recipe.method.quantization() else None
    if main and quantization:
        print(describe_quantization(quantization), flush=True)
    state, counters = LoopState(), None
    if resume_from is not None:
        state, counters = checkpoint.load_checkpoint(engine, resume_from, adapter=recipe.method.adapter())
        if main:
            print(
                f"resuming from {resume_from.path} (step {state.step} of {plan.total_steps}, epoch "
                f"{state.epoch + 1}, {state.micro_batches_done} micro-batches into it)",
                flush=True,
            )

    def evaluate(epoch: int, step: int) -> dict[str, Any]:
        from lorakit.evaluation import compute_metrics

        ev = recipe.eval
        max_new = auto_max_new_tokens(data) if ev.max_new_tokens == "auto" else ev.max_new_tokens
        out = evaluate_model(
            engine,
            built.inputs,
            data.eval,
            batching.eval_collator,
            tokenizer,
            batch_size=ev.micro_batch_size or t.micro_batch_size,
            generate=ev.generate,
            max_new_tokens=max_new,
            num_beams=ev.num_beams,
            zero3=zero3,
        )
        metrics = {"loss": out["loss"]}
        if ev.generate and main:
            metrics.update(
                compute_metrics(list(ev.metrics), out["predictions"], list(data.eval["reference"]))
            )
            rundir.write_predictions(run_dir, out["predictions"], list(data.eval["reference"]))
        log({"kind": "eval", "step": step, "epoch": epoch, **metrics})
        return metrics

    def save(reason: str) -> Path:
        state.metrics_records = log.records
        meter = trainer.meter
        return checkpoint.save_checkpoint(
            engine,
            recipe,
            run_dir,
            state,
            {"samples": meter.samples, "real": meter.real, "slots": meter.slots},
            adapter=recipe.method.adapter(),
            reason=reason,
        )

    progress = None
    if main:
        from tqdm.auto import tqdm

        progress = tqdm(
            total=plan.total_steps, initial=state.step, desc="training", unit="step", dynamic_ncols=True
        )
    ck = recipe.checkpoint
    stops = StopRequests()
    trainer = Trainer(
        engine,
        built.inputs,
        loader,
        sampler,
        plan,
        t.gradient_accumulation_steps,
        log,
        evaluate if recipe.eval_active() and data.eval is not None else None,
        progress,
        log_every=t.log_every,
        state=state,
        checkpointing=Checkpointing(save, ck.every, ck.at_epoch_end),
        nonfinite=NonFinitePolicy(t.on_nonfinite, t.max_skipped_steps),
        stop_requested=stops.requested,
    )
    if counters is not None:
        trainer.meter.samples, trainer.meter.real, trainer.meter.slots = (
            counters["samples"],
            counters["real"],
            counters["slots"],
        )
    try:
        with stops:
            trainer.run()
    except (Preempted, TrainingDiverged) as e:
        if main:
            # The launching process (lorakit.train over torchrun) reads this to exit with the same code.
            rundir.write_json(
                run_dir / EXIT, {"code": e.exit_code, "error": type(e).__name__, "message": str(e)}
            )
        log.close()
        release(engine, built)
        raise
    finally:
        if progress is not None:
            progress.close()

    # Between steps: what stays resident (weights, gradients, optimizer state), the planner's model states.
    (model_states,) = dist.all_reduce([live_tensor_bytes(device_kind) - tensors_before], op="max")
    saved = save_trained(engine, built, recipe, run_dir) if recipe.output.save_adapter else {}
    memory = peak_memory()
    gpu_peak, rss_peak = dist.all_reduce([memory["gpu"] or 0, memory["cpu_rss"]], op="max")
    summary = {
        "method": recipe.method.kind,
        "model": recipe.model.name_or_path,
        "model_source": built.source,
        "attention": built.attention,
        "dtype": recipe.model.dtype,
        "world_size": world,
        "zero_stage": recipe.distributed.zero_stage,
        "trainable_params": trainable,
        "total_params": total,
        "quantization": quantization,
        "steps": trainer.step,
        "epochs": plan.epochs,
        "train_samples": int(dist.all_reduce([trainer.meter.samples])[0]),
        "train_tokens": trainer.global_real_tokens,
        "padded_tokens": trainer.global_token_slots,
        "packing_efficiency": trainer.global_real_tokens / max(trainer.global_token_slots, 1),
        "batching": batching.summary(plan),
        "tokens_per_second": trainer.tokens_per_second(),
        "train_seconds": trainer.train_seconds,
        "peak_memory_bytes": {
            "gpu": int(gpu_peak) if memory["gpu"] is not None else None,
            "cpu_rss": int(rss_peak),
            "model_states": int(model_states),
        },
        # The memory planner's answer for this recipe and launch, next to what was measured above.
        "plan": _plan_of_run(recipe, config, data, world, device_kind),
        "loss": {
            "first": trainer.losses[0] if trainer.losses else None,
            "last": trainer.losses[-1] if trainer.losses else None,
        },
        "skipped_steps": list(state.skipped_steps),
        "resumed_from": {"checkpoint": str(resume_from.path), "step": resume_from.step}
        if resume_from
        else None,
        "last_checkpoint": str(trainer.last_checkpoint) if trainer.last_checkpoint else None,
        "eval": dict(state.eval) or None,
        "adapter_dir": saved.get("adapter_dir"),
        "model_dir": saved.get("model_dir"),
        # Set by lorakit.train once output.merge has merged (api.merge_after_training).
        "merged_dir": None,
        "data": {
            "cache_dir": str(data.path),
            "max_source_length": data.lengths.max_source_length,
            "max_target_length": data.lengths.max_target_length,
            "max_length": data.lengths.max_length,
            **data.stats,
        },
        "versions": rundir.versions(),
        "git_revision": rundir.git_revision(),
    }
    if main:
        rundir.write_json(run_dir / rundir.SUMMARY, summary)
        log.close()
    dist.barrier()
    release(engine, built)
    return TrainResult(run_dir, summary)


def _plan_of_run(recipe: Recipe, config, data, world: int, device_kind: str) -> dict[str, Any]:
    """lorakit.plan for this run (its launch shape, data lengths and device), recorded in summary.json so
    every run checks the planner; a model the planner does not know gives {"error": ...}, never a crash."""
    from lorakit.planner import plan

    local = int(os.environ.get("LOCAL_WORLD_SIZE", world))
    gpu_memory = torch.cuda.get_device_properties(0).total_memory if device_kind == "cuda" else None
    try:
        return plan(
            recipe,
            gpus=local,
            nodes=max(world // local, 1),
            config=config,
            device=device_kind,
            gpu_memory=gpu_memory,
            seq_len=data.lengths.max_source_length or data.lengths.max_length,
            target_len=data.lengths.max_target_length,
        ).to_dict()
    except Exception as e:  # noqa: BLE001 - the plan is a report; training already succeeded
        return {"error": f"{type(e).__name__}: {e}"}


def auto_max_new_tokens(data) -> int:
    """Generation cap when eval.max_new_tokens is auto: the target cap (seq2seq), else the longest eval
    response (causal: tokens after the prompt)."""
    if data.lengths.max_target_length is not None:
        return data.lengths.max_target_length
    return max(
        (
            length - len(prompt)
            for length, prompt in zip(data.eval["length"], data.eval["prompt_ids"], strict=True)
        ),
        default=1,
    )


def release(engine, built) -> None:
    """Undo the process-wide state a job leaves: ZeRO hooks, and transformers' "ZeRO-3 is on" flag, which
    would otherwise make every later from_pretrained in this process load partitioned."""
    from transformers.integrations.deepspeed import unset_hf_deepspeed_config

    engine.destroy()
    built.hf_ds_config = None
    unset_hf_deepspeed_config()
